"""Runs of the measured-gain benchmark run again (`--rerun`) replace the runs of the same folder in the earlier
result, in their place, marked with the reason and what the replaced run had reached; runs repeated (`--repeat`)
are added beside the earlier ones under names of their own."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_modules import load_benchmark_module

elastic_gain = load_benchmark_module("elastic_gain")


def run(name: str, steps: int, rate: float, code: int = 0) -> dict[str, object]:
    return {"policy": "static" if name.startswith("static") else name, "run_dir": f"/w/{name}", "steps": steps,
            "samples_per_s": rate, "exit_code": code}


def test_reruns_replace_the_runs_of_the_same_folder_in_place() -> None:
    earlier = {"runs": [run("static-1-7", 40, 20.0), run("static-2-6", 34, 31.7, code=1), run("elastic", 40, 50.0)]}
    merged = elastic_gain.replaced_runs(earlier, [run("static-2-6", 40, 45.0)], "a keep-alive race failed it")
    assert [(Path(str(r["run_dir"])).name, r["steps"], r["samples_per_s"]) for r in merged] == [
        ("static-1-7", 40, 20.0), ("static-2-6", 40, 45.0), ("elastic", 40, 50.0)]
    assert merged[1]["rerun"] == {"reason": "a keep-alive race failed it",
                                  "replaced": {"steps": 34, "samples_per_s": 31.7, "exit_code": 1, "error": None}}
    assert "rerun" not in merged[0] and "rerun" not in merged[2]


def test_a_rerun_of_a_run_the_result_lacks_is_added() -> None:
    merged = elastic_gain.replaced_runs({"runs": [run("static-1-7", 40, 20.0)]}, [run("elastic", 40, 50.0)], "x")
    assert [Path(str(r["run_dir"])).name for r in merged] == ["static-1-7", "elastic"]


@pytest.mark.parametrize(("taken", "expect"), [
    (set(), "static-4-4-repeat-1"),
    ({"static-4-4", "static-4-4-repeat-1"}, "static-4-4-repeat-2"),
    ({"static-4-4-repeat-2"}, "static-4-4-repeat-1"),
], ids=["first", "after-one", "fills-the-gap"])
def test_a_repeat_gets_the_first_free_name(taken: set[str], expect: str) -> None:
    assert elastic_gain.repeat_name("static-4-4", taken) == expect


def test_repeats_are_added_beside_the_earlier_runs() -> None:
    earlier = {"runs": [run("static-4-4", 40, 45.2), run("elastic", 40, 37.3)]}
    merged = elastic_gain.repeated_runs(earlier, [run("static-4-4-repeat-1", 40, 41.0)], "fast run or fast split")
    assert [(Path(str(r["run_dir"])).name, r["samples_per_s"]) for r in merged] == [
        ("static-4-4", 45.2), ("elastic", 37.3), ("static-4-4-repeat-1", 41.0)]
    assert merged[2]["repeat"] == {"reason": "fast run or fast split"}
    assert "repeat" not in merged[0] and "repeat" not in merged[1]


@pytest.mark.parametrize("argv", [
    ["--out", "/nonexistent/result.json", "--rerun", "static-2-6", "--reason", "r"],
    ["--out", __file__, "--rerun", "static-2-6"],
    ["--out", __file__, "--rerun", "static-2-6", "--reason", "r", "--only-ehp"],
    ["--out", __file__, "--repeat", "static-4-4"],
    ["--out", __file__, "--repeat", "static-4-4", "--rerun", "elastic", "--reason", "r"],
], ids=["no-earlier-result", "no-reason", "with-only-ehp", "repeat-without-reason", "repeat-and-rerun"])
def test_rerun_refuses_what_it_cannot_merge(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        elastic_gain.main(argv)
    assert info.value.code == 2
