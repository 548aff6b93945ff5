"""A live status reads its last reconfiguration, re-planning decision and the nodes left out (fenced, or held
back from lending) from an in-memory digest of the event log: the same answer as reading the run directory's
`events.jsonl`, with no file read per call."""

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


def fenced(node: str, ts: float) -> dict[str, Any]:
    return {"ts": ts, "kind": "node_fenced", "node_id": node, "address": f"10.0.0.{node}", "unreachable": ["10.0.0.9"],
            "reason": "training ranks there could not reach 10.0.0.9", "message": f"node 10.0.0.{node} is fenced off"}


def unfenced(node: str, ts: float) -> dict[str, Any]:
    return {"ts": ts, "kind": "node_unfenced", "node_id": node, "address": f"10.0.0.{node}"}


def held_back(node: str, ts: float, step: int) -> dict[str, Any]:
    return {"ts": ts, "kind": "ehp_held_back", "node_id": node, "address": f"10.0.0.{node}", "step": step,
            "instances": [f"rollout-{node}"], "unreachable": ["n9"], "reason": "it could not reach 10.0.0.9 (refused)"}


def lender_back(node: str, ts: float) -> dict[str, Any]:
    return {"ts": ts, "kind": "ehp_lender_back", "node_id": node, "address": f"10.0.0.{node}"}


def launch(ts: float) -> dict[str, Any]:
    return {"ts": ts, "kind": "launch", "message": "resuming an existing run"}


def shutdown(ts: float) -> dict[str, Any]:
    return {"ts": ts, "kind": "shutdown", "message": "finished", "step": 9}


NOISE = {"ts": 0.5, "kind": "step", "step": 1}
CASES = [
    ("nothing yet", [NOISE]),
    ("one running", [accepted(2, 1.0), requested(2, 1.1), NOISE]),
    ("one done", [accepted(2, 1.0), requested(2, 1.1), done(2, 3.0)]),
    ("the newest of two", [requested(2, 1.0), done(2, 2.0), accepted(3, 5.0), requested(3, 5.1)]),
    ("kept through many decisions", [accepted(2, 1.0), requested(2, 1.1), done(2, 2.0),
                                     *[decision(s, 3.0 + s) for s in range(500)]]),
    ("many reconfigurations", [e for g in range(2, 80) for e in (requested(g, g), done(g, g + 0.5))]),
    ("a node fenced and one held back", [fenced("1", 1.0), NOISE, held_back("2", 2.0, 5), NOISE]),
    ("both back", [fenced("1", 1.0), held_back("2", 2.0, 5), lender_back("2", 3.0), unfenced("1", 4.0)]),
    ("a new launch leaves none out", [fenced("1", 1.0), held_back("2", 2.0, 5), launch(3.0)]),
]

# (id, events, the nodes left out: (address, what they are left out of, since step))
LEFT_OUT = [
    ("none", [NOISE], []),
    ("fenced", [fenced("1", 1.0)], [("10.0.0.1", "fenced", None)]),
    ("fenced-then-back", [fenced("1", 1.0), unfenced("1", 2.0)], []),
    ("held-back", [held_back("2", 1.0, 5)], [("10.0.0.2", "held back from lending", 5)]),
    ("held-back-then-lends", [held_back("2", 1.0, 5), lender_back("2", 2.0)], []),
    ("the other kind's end does not end it", [fenced("1", 1.0), lender_back("1", 2.0)], [("10.0.0.1", "fenced", None)]),
    ("oldest-first", [held_back("2", 1.0, 5), fenced("1", 2.0)],
     [("10.0.0.2", "held back from lending", 5), ("10.0.0.1", "fenced", None)]),
    ("held-back-again-after-a-relaunch", [held_back("2", 1.0, 5), launch(2.0), held_back("2", 3.0, 9)],
     [("10.0.0.2", "held back from lending", 9)]),
    ("none-once-the-job-shut-down", [fenced("1", 1.0), held_back("2", 2.0, 5), shutdown(3.0)], []),
]


@pytest.mark.parametrize(("events", "expected"), [pytest.param(*c[1:], id=c[0]) for c in LEFT_OUT])
def test_nodes_left_out(events: list[dict[str, Any]], expected: list[tuple[str, str, int | None]],
                        tmp_path: Path) -> None:
    run = RunDir.at(str(tmp_path / "run"))
    run.create()
    run.events_jsonl.write_text("".join(json.dumps(e) + "\n" for e in events))
    left = run_dir_fields(run)["nodes_left_out"]
    assert [(n["address"], n["left_out"], n["step"]) for n in left] == expected
    assert all("could not reach 10.0.0.9" in n["reason"] for n in left)


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
    assert digest.fields() == {k: expected[k] for k in ("last_reconfiguration", "last_replan_decision",
                                                         "nodes_left_out")}
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


def test_status_text_names_each_node_left_out(tmp_path: Path) -> None:
    from libra.cli.cmd_status import _format, collect

    run = RunDir.at(str(tmp_path / "run"))
    run.create()
    run.events_jsonl.write_text("".join(json.dumps(e) + "\n" for e in (fenced("1", 1.0), held_back("2", 2.0, 5))))
    lines = _format(collect(str(run.root), events=0))
    assert ("node 10.0.0.1 fenced: training ranks there could not reach 10.0.0.9; checked again until it reaches "
            "them") in lines, lines
    assert ("node 10.0.0.2 held back from lending since step 5: it could not reach 10.0.0.9 (refused); its instances "
            "serve: rollout-2; checked again until it reaches them") in lines, lines
