"""The reliability benchmark's accounting of a fault from the run's records, and the manual's table being the
one rendered from the committed result."""

from __future__ import annotations

import json
from typing import Any

import pytest
from benchmark_modules import REPO, load_benchmark_module

acc = load_benchmark_module("reliability_accounting")


def rows(*steps: int, t0: float = 100.0, samples: int = 16) -> list[dict[str, Any]]:
    return [{"step": s, "samples": samples, "wall_time": t0 + i} for i, s in enumerate(steps)]


CASES = {
    # name: (before, final, resumed_step, exit code, expected figures)
    "clean-stop-resumed-at-its-step": (rows(1, 2, 3), rows(1, 2, 3) + rows(4, 5, 6, t0=200), 3, 0,
                                       {"survived": True, "samples_lost": 0, "samples_duplicated": 0,
                                        "steps_repeated": 0, "recovery_s": 50.0}),
    "resumed-from-an-older-checkpoint": (rows(1, 2, 3, 4), rows(1, 2) + rows(3, 4, 5, 6, t0=200), 2, 0,
                                         {"survived": True, "samples_lost": 0, "samples_duplicated": 0,
                                          "steps_repeated": 2, "recovery_s": 50.0}),
    "a-step-missing-and-one-short": (rows(1, 2), rows(1, 2) + rows(4, 6, t0=200) + rows(5, t0=300, samples=10),
                                     2, 0, {"survived": True, "samples_lost": 16 + 6, "samples_duplicated": 0,
                                            "steps_repeated": 0, "recovery_s": 50.0}),
    "a-step-counted-twice": (rows(1, 2), rows(1, 2, 2) + rows(3, 4, 5, 6, t0=200), 2, 0,
                             {"survived": True, "samples_lost": 0, "samples_duplicated": 16, "steps_repeated": 0,
                              "recovery_s": 50.0}),
    "did-not-finish": (rows(1, 2), rows(1, 2) + rows(3, t0=200), 2, 1,
                       {"survived": False, "samples_lost": 48, "samples_duplicated": 0, "steps_repeated": 0,
                        "recovery_s": 50.0}),
    "no-resume-no-step-after": (rows(1), rows(1), None, 1,
                                {"survived": False, "samples_lost": 80, "samples_duplicated": 0,
                                 "steps_repeated": 1, "recovery_s": None}),
}


@pytest.mark.parametrize(("before", "final", "resumed", "code", "expected"), CASES.values(), ids=CASES.keys())
def test_fault_figures(before: list[dict[str, Any]], final: list[dict[str, Any]], resumed: int | None, code: int,
                       expected: dict[str, Any]) -> None:
    figures = acc.fault_figures("f", before, final, resumed, 6, 16, fault_at=150.0, last_exit_code=code)
    assert {k: figures[k] for k in expected} == expected
    assert acc.target_met(figures) == (expected["survived"] and expected["steps_repeated"] == 0
                                       and expected["samples_lost"] == 0 and expected["samples_duplicated"] == 0)


@pytest.mark.parametrize(("details", "met"), [
    pytest.param({"thawed_processes_left": []}, True, id="a-node-back-left-nothing-running"),
    pytest.param({"thawed_processes_left": ["/usr/bin/python -m libra.rollout.server_guard"]}, False,
                 id="a-node-back-left-a-process-running"),
])
def test_a_node_that_came_back_must_leave_nothing_running(details: dict[str, Any], met: bool) -> None:
    fault = {"survived": True, "samples_lost": 0, "samples_duplicated": 0, "steps_repeated": 0, "details": details}
    assert acc.target_met(fault) is met



IN_RUN = {
    # name: (final rows, exit code, window of steps, expected figures); the fault at 150, recovered at 171.5
    "every-step-once": (rows(1, 2, 3, 4, 5, 6), 0, (3, 4),
                        {"survived": True, "samples_lost": 0, "samples_duplicated": 0, "steps_repeated": 0,
                         "recovery_s": 21.5}),
    "a-step-of-the-window-twice": (rows(1, 2, 3, 3, 4, 5, 6), 0, (3, 4),
                                   {"samples_lost": 0, "samples_duplicated": 16, "steps_repeated": 1}),
    "a-repeat-outside-the-window-is-another-fault-s": (rows(1, 1, 2, 3, 4, 5, 6), 0, (3, 4),
                                                       {"samples_duplicated": 0, "steps_repeated": 0}),
    "a-short-step-and-a-missing-one": (rows(1, 2, 4, 6) + rows(3, samples=12), 0, (3, 5),
                                       {"samples_lost": 4 + 16, "samples_duplicated": 0}),
    "job-did-not-finish": (rows(1, 2, 3), 1, (3, 4), {"survived": False, "samples_lost": 16}),
}


@pytest.mark.parametrize(("final", "code", "window", "expected"), IN_RUN.values(), ids=IN_RUN.keys())
def test_in_run_figures(final: list[dict[str, Any]], code: int, window: tuple[int, int],
                        expected: dict[str, Any]) -> None:
    figures = acc.in_run_figures("f", final, 16, 6, window[0], window[1], fault_at=150.0, recovered_at=171.5,
                                 last_exit_code=code)
    assert {k: figures[k] for k in expected} == expected

def test_replace_table_needs_its_markers() -> None:
    doc = f"intro\n{acc.TABLE_BEGIN}\nold\n{acc.TABLE_END}\noutro\n"
    assert acc.replace_table(doc, "new") == f"intro\n{acc.TABLE_BEGIN}\nnew\n{acc.TABLE_END}\noutro\n"
    with pytest.raises(ValueError, match="lacks the markers"):
        acc.replace_table("no markers", "new")


def test_manual_table_is_generated_from_the_committed_result() -> None:
    result = json.loads((REPO / "benchmarks" / "results" / "reliability.json").read_text())
    doc = (REPO / "cluster_manual" / "reliability.md").read_text()
    assert acc.replace_table(doc, acc.render_table(result)) == doc, (
        "cluster_manual/reliability.md is stale: python benchmarks/reliability.py --out "
        "benchmarks/results/reliability.json --update-doc cluster_manual/reliability.md")
