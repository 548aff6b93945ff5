"""The pool and reconfiguration fields of a job's status, the same whether read from the live job (operator
API) or from its run directory (`desired_state.json`, `events.jsonl`) once it has stopped.

Top-level keys: `state`, `step`, `rollout_gpus`, `rollout_instances`, `rollout_tp_size`, `train_gpus`,
`train_layout`, `reconfiguring`, `last_reconfiguration` (request, strategy, state, timings),
`last_replan_decision` (the newest `replan_decision` event of online re-planning, or None).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from libra.controller.state import DesiredState
from libra.run_dir import RunDir, read_jsonl

_RECONFIGURE_KINDS = ("reconfigure_requested", "reconfigure_done")
REPLAN_KIND = "replan_decision"


def pool_fields(desired: DesiredState | None) -> dict[str, Any]:
    if desired is None:
        return {"rollout_gpus": None, "rollout_instances": None, "rollout_tp_size": None, "train_gpus": None,
                "train_layout": None, "reconfiguring": ""}
    return {
        "rollout_gpus": desired.rollout_gpus,
        "rollout_instances": desired.rollout_instances,
        "rollout_tp_size": desired.rollout_tp,
        "train_gpus": desired.train_gpus,
        "train_layout": desired.train_layout.describe(desired.train_gpus),
        "reconfiguring": desired.reconfiguring,
    }


def last_reconfiguration(events: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The last reconfiguration the event log records as started: the request (the operator's KEY=VALUE list
    when it came through the API, else the change), the strategy, its state (running, done) and its timings.
    Refused and invalid requests changed nothing and are not reconfigurations (the event log has them)."""
    requested: dict[str, Any] | None = None
    done: dict[int, dict[str, Any]] = {}
    requests: dict[int, list[str]] = {}
    for event in events:
        kind = event.get("kind")
        if kind == "reconfigure_requested":
            requested = event
        elif kind == "reconfigure_done":
            done[int(event.get("generation") or 0)] = event
        elif kind == "operator" and event.get("call") == "Reconfigure" and event.get("outcome") == "accepted":
            requests[int(event.get("generation") or 0)] = list(event.get("request") or [])
    if requested is None:
        return None
    generation = int(requested.get("generation") or 0)
    finished = done.get(generation)
    timings: dict[str, Any] = {"requested_at": requested.get("ts")}
    if finished is not None:
        timings.update(done_at=finished.get("ts"), seconds=finished.get("seconds"))
    return {
        "request": requests.get(generation) or requested.get("message", ""),
        "change": requested.get("message", ""),
        "strategy": requested.get("strategy", ""),
        "generation": generation,
        "state": "done" if finished is not None else "running",
        "timings": timings,
    }


def last_replan_decision(events: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest decision of online re-planning, taken or not (None: none was made)."""
    last = None
    for event in events:
        if event.get("kind") == REPLAN_KIND:
            last = event
    return last


def run_dir_fields(run: RunDir) -> dict[str, Any]:
    """The pool and reconfiguration fields as the run directory records them."""
    fields = pool_fields(DesiredState.load(run.desired_state_json) if run.desired_state_json.exists() else None)
    events = [e for e in read_jsonl(run.events_jsonl)
              if e.get("kind") in (*_RECONFIGURE_KINDS, "operator", REPLAN_KIND)]
    fields["last_reconfiguration"] = last_reconfiguration(events)
    fields["last_replan_decision"] = last_replan_decision(events)
    return fields
