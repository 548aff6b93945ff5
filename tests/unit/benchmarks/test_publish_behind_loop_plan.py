"""The publish-behind-the-loop benchmark's launch plan: each run's steps come from its reload method and its
baseline twin follows it, whatever the runs are called."""

from __future__ import annotations

from pathlib import Path

from benchmark_modules import load_benchmark_module

publish_behind_loop = load_benchmark_module("publish_behind_loop")


def test_without_a_baseline_every_run_once_on_this_code() -> None:
    plan = publish_behind_loop.planned_runs(None)
    assert [name for name, _, _ in plan] == list(publish_behind_loop.RUNS)
    assert {repo for _, _, repo in plan} == {publish_behind_loop.e2e_dev.REPO}


def test_each_lagged_run_is_followed_by_its_baseline_twin() -> None:
    baseline = Path("/tmp/baseline-repo")
    plan = [(name, repo) for name, _, repo in publish_behind_loop.planned_runs(baseline)]
    here = publish_behind_loop.e2e_dev.REPO
    assert plan == [("sync_inplace", here), ("lag1_inplace", here), ("lag1_inplace_baseline", baseline),
                    ("lag1_restart", here), ("lag1_restart_baseline", baseline)]


def test_only_the_restart_runs_take_the_restart_step_count() -> None:
    restart = {name for name, run in publish_behind_loop.RUNS.items() if run.restart_reload}
    assert restart == {"lag1_restart"}
    assert all(("rollout_weight_reload_method=restart" in run.overrides) == run.restart_reload
               for run in publish_behind_loop.RUNS.values())
