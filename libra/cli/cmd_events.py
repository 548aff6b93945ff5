"""`libra events RUN_DIR [--follow] [--last N] [--json]`: the controller's event log, from the live job (its
operator API) or, once it has stopped, from `events.jsonl`."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from libra.cli.operator_call import EXIT_INVALID, EXIT_OK, add_run_dir, rpc_failure


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "events", help="show (and follow) a job's event log",
        description="Print the last events of the job in RUN_DIR; with --follow, keep printing new ones until the "
                    "job stops (Ctrl-C to leave).",
    )
    add_run_dir(parser)
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    parser.add_argument("--last", type=int, default=20, metavar="N", help="events shown first (default 20)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.set_defaults(func=run)


def line(event: dict[str, Any]) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(float(event.get("ts", 0))))
    details = event.get("message") or " ".join(
        f"{k}={v}" for k, v in event.items() if k not in ("ts", "kind", "info", "history"))
    return f"{when} {event.get('kind')}: {details}"


def run(args: argparse.Namespace) -> int:
    from libra.api.auth import TokenUnreadable
    from libra.api.client import JobNotRunning, OperatorClient
    from libra.run_dir import RunDir

    run_dir = RunDir.at(args.run_dir)
    if not run_dir.events_jsonl.exists():
        print(f"error: {args.run_dir} has no events.jsonl; pass the directory a `libra launch` wrote")
        return EXIT_INVALID
    show = (lambda e: json.dumps(e)) if args.json else line
    try:
        client = OperatorClient.for_run_dir(run_dir.root)
    except (JobNotRunning, TokenUnreadable):
        client = None
    if client is None:
        for event in run_dir.tail_events(max(0, args.last)) if args.last else []:
            print(show(event), flush=True)
        if args.follow:
            print("(the job is not running: nothing to follow)")
        return EXIT_OK
    with client:
        try:
            for message in client.events(replay=max(0, args.last), follow=args.follow):
                print(show(json.loads(message.json)), flush=True)
        except Exception as exc:
            return rpc_failure(exc)
    return EXIT_OK
