"""The pool and reconfiguration fields of a job's status, the same whether read from the live job (operator
API) or from its run directory (`desired_state.json`, `events.jsonl`) once it has stopped.

Top-level keys: `state`, `step`, `rollout_gpus`, `rollout_instances`, `rollout_tp_size`, `train_gpus`,
`train_layout`, `reconfiguring`, `last_reconfiguration` (request, strategy, state, timings),
`last_replan_decision` (the newest `replan_decision` event of online re-planning, or None), `nodes_left_out`
(the nodes the running launch leaves out because they could not reach their peers: fenced training nodes and
rollout nodes held back from lending, each until it reaches them again).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from libra.controller.state import DesiredState
from libra.run_dir import RunDir, read_jsonl

_RECONFIGURE_KINDS = ("reconfigure_requested", "reconfigure_done")
REPLAN_KIND = "replan_decision"
# node left out -> (what it is left out of, the event that ends it)
_LEFT_OUT_KINDS = {"node_fenced": ("fenced", "node_unfenced"), "ehp_held_back": ("held back from lending",
                                                                               "ehp_lender_back")}
_LEFT_OUT_END_KINDS = {end: start for start, (_, end) in _LEFT_OUT_KINDS.items()}
# a launch starts with no node left out, and a controller that shut down leaves none (the fence lives in it)
_AFRESH_KINDS = ("launch", "shutdown")


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


class NodesLeftOut:
    """The nodes the newest launch leaves out, followed event by event: a `node_fenced` or `ehp_held_back` event
    adds one, its `node_unfenced` or `ehp_lender_back` takes it out, and a `launch` or a `shutdown` leaves none."""

    def __init__(self) -> None:
        self._left: dict[tuple[str, str], dict[str, Any]] = {}

    @staticmethod
    def reads(event: dict[str, Any]) -> bool:
        kind = event.get("kind")
        return kind in _LEFT_OUT_KINDS or kind in _LEFT_OUT_END_KINDS or kind in _AFRESH_KINDS

    def add(self, event: dict[str, Any]) -> None:
        """Follow `event` (any event: those it does not read change nothing)."""
        kind = str(event.get("kind"))
        if kind in _AFRESH_KINDS:
            self._left.clear()
        elif kind in _LEFT_OUT_KINDS:
            self._left[(kind, str(event.get("node_id")))] = {
                "address": event.get("address", ""), "node_id": event.get("node_id"),
                "left_out": _LEFT_OUT_KINDS[kind][0], "since": event.get("ts"), "step": event.get("step"),
                "reason": event.get("reason", ""), "instances": list(event.get("instances") or [])}
        elif kind in _LEFT_OUT_END_KINDS:
            self._left.pop((_LEFT_OUT_END_KINDS[kind], str(event.get("node_id"))), None)

    def fields(self) -> list[dict[str, Any]]:
        return sorted(self._left.values(), key=lambda n: (float(n.get("since") or 0.0), str(n["address"])))


def run_dir_fields(run: RunDir) -> dict[str, Any]:
    """The pool and reconfiguration fields as the run directory records them."""
    fields = pool_fields(DesiredState.load(run.desired_state_json) if run.desired_state_json.exists() else None)
    events = list(read_jsonl(run.events_jsonl))
    reconfigurations = [e for e in events if e.get("kind") in (*_RECONFIGURE_KINDS, "operator", REPLAN_KIND)]
    fields["last_reconfiguration"] = last_reconfiguration(reconfigurations)
    fields["last_replan_decision"] = last_replan_decision(reconfigurations)
    left_out = NodesLeftOut()
    for event in events:
        left_out.add(event)
    fields["nodes_left_out"] = left_out.fields()
    return fields


def _reconfiguration_event(event: dict[str, Any]) -> bool:
    """Whether `last_reconfiguration` reads `event`."""
    kind = event.get("kind")
    return kind in _RECONFIGURE_KINDS or (kind == "operator" and event.get("call") == "Reconfigure"
                                          and event.get("outcome") == "accepted")


def _event_key(event: dict[str, Any]) -> tuple[Any, ...]:
    return event.get("ts"), event.get("kind"), event.get("generation"), event.get("message")


class StatusDigest:
    """What a live status reports from the event log (the last reconfiguration, the last re-planning decision),
    kept in memory as the job emits the events, so that a status call reads no file: read once from the run's
    `events.jsonl` (earlier launches of the run included), then followed."""

    KEEP_RECONFIGURATION_EVENTS = 64  # a reconfiguration writes up to 3 of them; the newest one is what counts

    def __init__(self) -> None:
        self._reconfiguration: deque[dict[str, Any]] = deque(maxlen=self.KEEP_RECONFIGURATION_EVENTS)
        self._replan: dict[str, Any] | None = None
        self._left_out = NodesLeftOut()
        self._lock = threading.Lock()

    @staticmethod
    def reads(event: dict[str, Any]) -> bool:
        """Whether the digest keeps or follows `event`."""
        return _reconfiguration_event(event) or event.get("kind") == REPLAN_KIND or NodesLeftOut.reads(event)

    def add(self, event: dict[str, Any]) -> None:
        with self._lock:
            if _reconfiguration_event(event):
                self._reconfiguration.append(event)
            elif event.get("kind") == REPLAN_KIND:
                self._replan = event
            else:
                self._left_out.add(event)

    @classmethod
    def follow(cls, subscribe: Callable[[Callable[[dict[str, Any]], None]], Callable[[], None]],
               events_jsonl: Path) -> tuple[StatusDigest, Callable[[], None]]:
        """A digest of `events_jsonl` that follows the events `subscribe` delivers from now on; with the
        unsubscribe. Events emitted while the file is read are added once, after it."""
        digest = cls()
        arrived: list[dict[str, Any]] = []
        handoff = threading.Lock()
        seeded = False

        def listener(event: dict[str, Any]) -> None:
            with handoff:
                if seeded:
                    digest.add(event)
                else:
                    arrived.append(event)

        unsubscribe = subscribe(listener)
        on_file = set()
        for event in read_jsonl(events_jsonl):
            if digest.reads(event):
                digest.add(event)
                on_file.add(_event_key(event))
        with handoff:
            for event in arrived:
                if _event_key(event) not in on_file:
                    digest.add(event)
            seeded = True
        return digest, unsubscribe

    def fields(self) -> dict[str, Any]:
        """`last_reconfiguration`, `last_replan_decision` and `nodes_left_out`, as `run_dir_fields` reads them
        from the file."""
        with self._lock:
            reconfiguration = list(self._reconfiguration)
            replan = self._replan
            left_out = self._left_out.fields()
        return {"last_reconfiguration": last_reconfiguration(reconfiguration), "last_replan_decision": replan,
                "nodes_left_out": left_out}
