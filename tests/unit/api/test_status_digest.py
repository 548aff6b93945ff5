"""A live status reads its last reconfiguration and re-planning decision from an in-memory digest of the
event log: the same answer as reading the run directory's `events.jsonl`, with no file read per call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from libra.api.status import StatusDigest, run_dir_fields
from libra.controller.events import EventLog
from libra.run_dir import RunDir


def requested(generation: int, ts: float) -> dict[str, Any]:
    return {"ts": ts, "kind": "reconfigure_requested", "generation": generation, "strategy": "diff",
            "message": f"rollout 2 -> {generation}"}


def done(generation: int, ts: float) -> dict[str, Any]:
    return {"ts": ts, "kind": "reconfigure_done", "generation": generation, "seconds": ts - 1}


def accepted(generation: int, ts: float) -> dict[str, Any]:
    return {"ts": ts, "kind": "operator", "call": "Reconfigure", "outcome": "accepted", "generation": generation,
            "request": [f"rollout_gpus={generation}"], "message": "Reconfigure: accepted"}


def decision(step: int, ts: float) -> dict[str, Any]:
    return {"ts": ts, "kind": "replan_decision", "step": step, "action": "kept", "message": "inside the band"}


NOISE = {"ts": 0.5, "kind": "step", "step": 1}
CASES = [
    ("nothing yet", [NOISE]),
    ("one running", [accepted(2, 1.0), requested(2, 1.1), NOISE]),
    ("one done", [accepted(2, 1.0), requested(2, 1.1), done(2, 3.0)]),
    ("the newest of two", [requested(2, 1.0), done(2, 2.0), accepted(3, 5.0), requested(3, 5.1)]),
    ("kept through many decisions", [accepted(2, 1.0), requested(2, 1.1), done(2, 2.0),
                                     *[decision(s, 3.0 + s) for s in range(500)]]),
    ("many reconfigurations", [e for g in range(2, 80) for e in (requested(g, g), done(g, g + 0.5))]),
]


@pytest.mark.parametrize("events", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_the_digest_answers_as_the_run_directory_does(events: list[dict[str, Any]], tmp_path: Path) -> None:
    run = RunDir.at(str(tmp_path / "run"))
    run.create()
    half = len(events) // 2
    run.events_jsonl.write_text("".join(json.dumps(e) + "\n" for e in events[:half]))
    log = EventLog(None)
    digest, unsubscribe = StatusDigest.follow(log.subscribe, run.events_jsonl)
    for event in events[half:]:  # the rest arrives live, as the job emits it
        for listener in list(log._listeners):
            listener(dict(event))
        with run.events_jsonl.open("a") as fh:
            fh.write(json.dumps(event) + "\n")
    expected = run_dir_fields(run)
    assert digest.fields() == {k: expected[k] for k in ("last_reconfiguration", "last_replan_decision")}
    unsubscribe()
    assert not log._listeners


def test_an_event_emitted_while_the_file_is_read_counts_once(tmp_path: Path) -> None:
    """The listener is attached before the file is read: an event both on file and delivered is added once."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    first = log.emit("reconfigure_requested", "rollout 2 -> 3", generation=2, strategy="diff")

    def subscribe_then_emit(listener: Any) -> Any:
        unsubscribe = log.subscribe(listener)
        log.emit("reconfigure_done", generation=2, seconds=1.0)
        listener(first)  # delivered late, and already on file
        return unsubscribe

    digest, _ = StatusDigest.follow(subscribe_then_emit, path)
    assert digest.fields()["last_reconfiguration"]["state"] == "done"
    assert len(digest._reconfiguration) == 2
