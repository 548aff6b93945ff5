"""`libra status` shows the last decision of online re-planning, read from the run's event log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from libra.api.status import last_replan_decision, run_dir_fields
from libra.cli.cmd_status import _format, _replan_memory, collect
from libra.run_dir import RunDir

KEPT = {"kind": "replan_decision", "step": 5, "action": "kept", "gain": 0.01, "message": "inside the band"}
TAKEN = {"kind": "replan_decision", "step": 10, "action": "requested", "gain": 0.4, "message": "+40.0% samples/s",
         "reviewing_change_at": 10, "over_predictions": {"training": {"step": 4, "share": 0.061}}}
OTHER = {"kind": "reconfigure_done", "generation": 2, "seconds": 12.0}

CASES = [
    ("none made", [OTHER], None),
    ("the newest wins", [KEPT, OTHER, TAKEN, OTHER], TAKEN),
    ("a decision not taken counts", [TAKEN, KEPT], KEPT),
]


@pytest.mark.parametrize(("events", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_last_replan_decision(events: list[dict[str, Any]], expected: dict[str, Any] | None) -> None:
    assert last_replan_decision(events) == expected


def test_status_json_and_text_show_the_last_decision(tmp_path: Path) -> None:
    run = RunDir.at(str(tmp_path / "run"))
    run.create()
    run.events_jsonl.write_text("".join(json.dumps(e) + "\n" for e in (KEPT, TAKEN)))
    assert run_dir_fields(run)["last_replan_decision"]["step"] == 10
    info = collect(str(run.root), events=0)
    assert info["last_replan_decision"]["action"] == "requested"
    lines = _format(info)
    assert any(line.startswith("last re-planning decision (step 10): requested, predicted gain +40.0%")
               for line in lines)
    assert ("re-planner: reviewing the change at step 10; discounts growing the training pool by 6.1% "
            "(over-predicted at step 4)") in lines, lines


def test_status_says_which_undone_change_is_not_made_again() -> None:
    undone = KEPT | {"over_predictions": {"rollout": {"step": 3, "share": 0.3}},
                     "undone": {"step": 9, "change_step": 3, "response_tokens": 40.0}}
    assert _replan_memory(undone) == ("discounts growing the rollout pool by 30.0% (over-predicted at step 3); does "
                                      "not make the change at step 3 again (undone at step 9) while the mean "
                                      "response stays near 40 tokens")


@pytest.mark.parametrize("decision", [
    pytest.param(KEPT | {"reviewing_change_at": None, "over_predictions": {}, "undone": None},
                 id="nothing-remembered"),
    pytest.param(KEPT, id="a-record-from-before-the-fields"),
])
def test_a_decision_without_memory_adds_no_line(decision: dict[str, Any]) -> None:
    assert _replan_memory(decision) == ""
