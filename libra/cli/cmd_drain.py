"""`libra drain RUN_DIR [--wait]`: finish the step in flight, save a checkpoint and stop a running job, whose
`libra launch` then exits 0 (through the job's operator API)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from libra.cli.operator_call import EXIT_OK, EXIT_REFUSED, add_run_dir, control


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "drain", help="finish the step in flight, checkpoint and stop a running job",
        description="Drain the job in RUN_DIR: the step in flight finishes, a checkpoint is saved, every server "
                    "and worker stops and its `libra launch` exits 0. Exit 0 when the drain was accepted (with "
                    "--wait: once the job has stopped), 1 when refused.",
    )
    add_run_dir(parser)
    parser.add_argument("--reason", default="", help="free text recorded in the event log")
    parser.add_argument("--wait", action="store_true", help="return once the job has stopped")
    parser.add_argument("--timeout", type=float, default=1800.0, metavar="S", help="--wait gives up after S seconds")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    code = control(args, "drain")
    if code != EXIT_OK or not args.wait:
        return code
    from libra.api.auth import read_address
    from libra.run_dir import RunDir

    run_dir = RunDir.at(args.run_dir)
    deadline = time.monotonic() + args.timeout
    while read_address(run_dir.root) is not None:  # the controller removes it as the very last step
        if time.monotonic() > deadline:
            print(f"refused: the job did not stop within {args.timeout:.0f}s; see {run_dir.events_jsonl}")
            return EXIT_REFUSED
        time.sleep(1.0)
    # the API stops just before the controller writes its final state
    status = run_dir.read_status() or {}
    for _ in range(60):
        if status.get("state") not in ("running", "paused", "stopping"):
            break
        time.sleep(0.5)
        status = run_dir.read_status() or {}
    print(f"drain: the job stopped: {status.get('state', 'unknown')} at step {status.get('step', '?')}")
    return EXIT_OK
