"""`libra status RUN_DIR [--events N] [--json]`: where a run stands.

Works while the job runs and after it ended (or died): state, step, reward, pools, checkpoints and the last
controller events, from `status.json`, `metrics.jsonl`, `events.jsonl` and `checkpoints/`. While the job runs,
state, step, the pools (`rollout_gpus`, `rollout_instances`, `rollout_tp_size`, `train_gpus`, `train_layout`),
`last_reconfiguration` and the nodes left out (`nodes_left_out`: fenced, or held back from lending) come from
its operator API (`live: true`); otherwise from `desired_state.json` and the event log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

EXIT_OK = 0
EXIT_INVALID = 2


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "status", help="show the state of a run",
        description="Show the state, step, reward, pools, checkpoints and last events of the run in RUN_DIR.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (e.g. runs/dev)")
    parser.add_argument("--events", type=int, default=8, metavar="N", help="last N events to show (default 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(func=run)


def _process_alive(status: dict[str, Any]) -> bool | None:
    """Whether the controller process still runs (None when it ran on another host)."""
    from libra.run_dir import process_alive_here

    return process_alive_here(status.get("pid"), status.get("host"))


def collect(run_dir: str, events: int) -> dict[str, Any]:
    from libra.api.status import run_dir_fields
    from libra.run_dir import RunDir

    run = RunDir.at(run_dir)
    status = run.read_status() or {}
    rows = run.read_metrics()
    checkpoints = [step for step, _ in run.checkpoints_by_step()]
    state = status.get("state", "unknown")
    alive = _process_alive(status)
    if state in ("starting", "running", "stopping") and alive is False:
        state = f"{state} (controller process gone: it stopped without clean-up; launch again to resume)"
    last = rows[-1] if rows else status.get("last_row", {})
    return {
        "run_dir": str(run.root),
        "name": status.get("name", os.path.basename(str(run.root))),
        "state": state,
        "pid": status.get("pid"),
        "alive": alive,
        "updated_at": status.get("updated_at"),
        "step": last.get("step", status.get("step", 0)),
        "total_steps": status.get("total_steps"),
        "last_row": last,
        "best_reward": max((r.get("reward_mean", 0.0) for r in rows), default=None),
        "pools": status.get("pools", {}),
        "checkpoints": checkpoints,
        "error": status.get("error", ""),
        "events": run.tail_events(events),
        "live": False,
        **run_dir_fields(run),
    }


def live_fields(run_dir: str) -> dict[str, Any] | None:
    """State, step, pools and last reconfiguration from the running job's operator API (None: not running)."""
    from libra.api.auth import TokenUnreadable
    from libra.api.client import JobNotRunning, OperatorClient

    try:
        with OperatorClient.for_run_dir(run_dir, timeout_s=10) as client:
            reply = client.status()
    except (JobNotRunning, TokenUnreadable):
        return None
    return {**json.loads(reply.status_json), "live": True}


def _format(info: dict[str, Any]) -> list[str]:
    from libra.observability.console import step_line

    lines = []
    age = ""
    if isinstance(info.get("updated_at"), int | float):
        age = f", updated {time.time() - info['updated_at']:.0f}s ago"
    pid = f", pid {info['pid']}" if info.get("pid") else ""
    source = " (live)" if info.get("live") else ""
    lines.append(f"run {info['name']} ({info['run_dir']}): {info['state']}{source}{pid}{age}")
    if info.get("error"):
        lines.append(f"error: {info['error']}")
    row = info.get("last_row") or {}
    if row:
        lines.append(step_line(row, info.get("total_steps") or 0))
    else:
        lines.append(f"step {info['step']}/{info.get('total_steps') or '?'} (no training step finished yet)")
    if info.get("best_reward") is not None:
        lines.append(f"best batch reward {info['best_reward']:.3f}")
    if info.get("rollout_gpus") is not None:
        lines.append(f"split: rollout {info['rollout_instances']} x TP{info['rollout_tp_size']} "
                     f"({info['rollout_gpus']} GPUs), train {info['train_gpus']} GPUs {info['train_layout']}"
                     + (f"; reconfiguring: {info['reconfiguring']}" if info.get("reconfiguring") else ""))
    last = info.get("last_reconfiguration")
    if last:
        seconds = (last.get("timings") or {}).get("seconds")
        took = f" in {seconds:.1f}s" if isinstance(seconds, int | float) else ""
        request = " ".join(last["request"]) if isinstance(last.get("request"), list) else last.get("request")
        lines.append(f"last reconfiguration: {request} by {last.get('strategy') or '?'}: {last.get('state')}{took}")
    decision = info.get("last_replan_decision")
    if decision:
        gain = decision.get("gain")
        lines.append(f"last re-planning decision (step {decision.get('step')}): {decision.get('action')}"
                     + (f", predicted gain {gain:+.1%}" if isinstance(gain, int | float) else "")
                     + f": {decision.get('message', '')}")
        memory = _replan_memory(decision)
        if memory:
            lines.append(f"re-planner: {memory}")
    for node in info.get("nodes_left_out") or []:
        when = f" since step {node['step']}" if node.get("step") is not None else ""
        why = f": {node['reason']}" if node.get("reason") else ""
        serving = f"; its instances serve: {', '.join(node['instances'])}" if node.get("instances") else ""
        lines.append(f"node {node.get('address') or node.get('node_id')} {node.get('left_out')}{when}{why}"
                     f"{serving}; checked again until it reaches them")
    for name, pool in (info.get("pools") or {}).items():
        members = ", ".join(f"{k} {v}" for k, v in sorted((pool.get("members") or {}).items()))
        extra = pool.get("layout") or f"{pool.get('desired_instances', '?')} instances wanted"
        lines.append(f"{name} pool: {pool.get('gpus', '?')} GPUs, {extra}; members: {members or 'none'}")
    checkpoints = info.get("checkpoints") or []
    lines.append(f"checkpoints: {', '.join(str(s) for s in checkpoints) if checkpoints else 'none'}")
    if info.get("events"):
        lines.append("last events:")
        for event in info["events"]:
            when = time.strftime("%H:%M:%S", time.localtime(float(event.get("ts", 0))))
            details = event.get("message") or " ".join(
                f"{k}={v}" for k, v in event.items() if k not in ("ts", "kind", "info", "history")
            )
            lines.append(f"  {when} {event.get('kind')}: {str(details)[:120]}")
    return lines


def run(args: argparse.Namespace) -> int:
    from libra.run_dir import RunDir

    run_dir = RunDir.at(args.run_dir)
    if not run_dir.root.is_dir() or not (run_dir.status_json.exists() or run_dir.config_yaml.exists()):
        print(f"error: {args.run_dir} is not a run directory (no status.json or config.yaml); pass the "
              "directory a `libra launch` wrote, e.g. runs/dev", file=sys.stderr)
        return EXIT_INVALID
    info = collect(args.run_dir, args.events)
    live = live_fields(args.run_dir)
    if live is not None:
        info.update(live)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print("\n".join(_format(info)))
    return EXIT_OK


def _replan_memory(decision: dict[str, Any]) -> str:
    """The re-planner's memory after `decision`, in words ("" when it holds nothing)."""
    parts = []
    reviewing = decision.get("reviewing_change_at")
    if isinstance(reviewing, int):
        parts.append(f"reviewing the change at step {reviewing}")
    for pool, over in sorted((decision.get("over_predictions") or {}).items()):
        if isinstance(over, dict) and isinstance(over.get("share"), int | float):
            parts.append(f"discounts growing the {pool} pool by {over['share']:.1%} (over-predicted at step "
                         f"{over.get('step')})")
    undone = decision.get("undone")
    if isinstance(undone, dict) and isinstance(undone.get("response_tokens"), int | float):
        parts.append(f"does not make the change at step {undone.get('change_step')} again (undone at step "
                     f"{undone.get('step')}) while the mean response stays near {undone['response_tokens']:.0f} tokens")
    return "; ".join(parts)
