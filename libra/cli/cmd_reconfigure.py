"""`libra reconfigure RUN_DIR [--set KEY=VALUE ...] [--strategy NAME] [--dry-run] [--wait]`: change a running
job through its operator API.

The overrides are the `--set` of `libra launch` (e.g. `rollout_gpus=3`, `rollout_tp_size=2`, `train_gpus=1`),
checked by the configuration's rules against the job as it runs now. Exit 0 when accepted (with `--wait`: once
applied; with `--dry-run`: the plan is printed, nothing changes), 2 when the request is invalid (every error
with field, value, rule and fix), 1 when the job refuses it (another reconfiguration runs, the job is ending or
not running), each with a one-line reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from libra.cli.operator_call import (
    EXIT_INVALID,
    EXIT_OK,
    EXIT_REFUSED,
    add_run_dir,
    connect,
    refuse,
    rpc_failure,
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "reconfigure", help="change a running job (pool sizes, TP, strategy); --dry-run shows the plan",
        description="Change the job in RUN_DIR while it runs, with the same KEY=VALUE overrides as --set of "
                    "libra launch. Exit 0 accepted (with --wait: applied), 2 invalid, 1 refused.",
    )
    add_run_dir(parser)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="one change, e.g. rollout_gpus=3 or rollout_tp_size=2; repeatable, the last one wins")
    parser.add_argument("--strategy", default="", metavar="NAME",
                        help="how the rollout pool moves: diff, restart_all, blue_green, prewarm, cluster_swap "
                             "(default: the job's runtime_rollout_reconfigure_strategy)")
    parser.add_argument("--dry-run", action="store_true", help="print the action plan and its cost; change nothing")
    parser.add_argument("--wait", action="store_true", help="return once the change is applied")
    parser.add_argument("--timeout", type=float, default=1800.0, metavar="S", help="--wait gives up after S seconds")
    parser.add_argument("--json", action="store_true", help="print the reply as one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from libra.api.generated import operator_pb2 as pb

    client = connect(args.run_dir)
    if client is None:
        return EXIT_REFUSED
    with client:
        try:
            reply = client.reconfigure(args.overrides, args.strategy, args.dry_run)
        except Exception as exc:
            return rpc_failure(exc)
        outcome = pb.ReconfigureReply.Outcome
        if args.json:
            print(json.dumps(MessageToDict(reply), indent=2))
        if reply.outcome == outcome.INVALID:
            print(f"invalid: {reply.reason}", file=sys.stderr)
            for e in reply.errors:
                print(f"  {e.kind}: {e.field} = {e.value}: {e.rule}. Fix: {e.fix}"
                      + (f" [{e.rule_id}]" if e.rule_id else ""), file=sys.stderr)
            return EXIT_INVALID
        if reply.outcome == outcome.REFUSED:
            return refuse(reply.reason)
        if reply.outcome == outcome.PLANNED:
            if not args.json:
                print("\n".join(plan_lines(reply)))
            return EXIT_OK
        if not reply.reconfiguring:  # recorded only (runtime_training_pool_plan_only): nothing to wait for
            if not args.json:
                print(reply.reason)
            return EXIT_OK
        if not args.json:
            print(f"accepted: {reply.reconfiguring} (generation {reply.generation}, strategy {reply.strategy})")
        if args.wait:
            return _wait(client, reply.reconfiguring, args.timeout)
    return EXIT_OK


def _wait(client: Any, label: str, timeout_s: float) -> int:
    from libra.api.client import JobNotRunning
    from libra.api.service import ENDED_STATES

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            status = client.status()
        except JobNotRunning:
            return refuse(f"the job stopped before the change was applied ({label})")
        if status.state in ENDED_STATES:
            return refuse(f"the job is {status.state} and will not apply the change ({label})")
        if status.reconfiguring != label:
            last = json.loads(status.status_json).get("last_reconfiguration") or {}
            seconds = (last.get("timings") or {}).get("seconds")
            took = f" in {seconds:.1f}s" if isinstance(seconds, int | float) else ""
            print(f"applied: {label}{took}; rollout {status.rollout_instances} x TP{status.rollout_tp_size} "
                  f"({status.rollout_gpus} GPUs), train {status.train_gpus} GPUs {status.train_layout}")
            return EXIT_OK
        time.sleep(1.0)
    return refuse(f"not applied within {timeout_s:.0f}s ({label}); it continues: watch libra status")


def plan_lines(reply: Any) -> list[str]:
    plan = reply.plan
    lines = [f"dry run: {reply.reconfiguring} (nothing changed)",
             f"  rollout:  {plan.rollout_before} -> {plan.rollout_after}",
             f"  training: {plan.train_layout_before} -> {plan.train_layout_after}",
             f"  predicted step: {plan.step_s_before:.3g}s -> {plan.step_s_after:.3g}s, "
             f"{plan.samples_per_s_before:.3g} -> {plan.samples_per_s_after:.3g} samples/s (planner cost model)",
             f"  expected switch: {plan.switch_cost_s:.0f}s until the new set serves, "
             f"{plan.serving_gap_s:.0f}s of it with fewer instances serving",
             "  actions (tick, action, member, detail, reason):"]
    for a in plan.actions:
        lines.append(f"    {a.tick:>3}  {a.kind:<22} {a.member or '-':<24} {a.detail or '-'}: {a.reason}")
    lines += [f"  note: {note}" for note in plan.notes]
    return lines
