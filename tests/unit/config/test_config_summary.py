"""The configuration summary says what runs: never "reconfiguration on" for options nothing acts on yet."""

from __future__ import annotations

import dataclasses

import pytest
from config_bases import gpu_base

from libra.cli.main import main
from libra.config import load_dict
from libra.config.summary import summarize

GRP = "global_resource_planner"


def runtime_line(cfg: object) -> str:
    return next(line for line in summarize(cfg) if line.startswith("runtime"))  # type: ignore[arg-type]


def test_runtime_line_of_a_valid_job_says_what_runs() -> None:
    line = runtime_line(load_dict(gpu_base()))
    assert "reconfiguration off" in line and "started and replaced by Libra" in line
    assert "600 s x 4 attempt(s)" in line


def test_online_replanning_is_reported_when_on() -> None:
    cfg = load_dict(gpu_base())
    planner = dataclasses.replace(cfg.global_resource_planner, runtime_dynamic_reconfiguration_enabled=True,
                                  runtime_online_replanning=True, replan_interval_steps=7, replan_min_gain=0.25)
    line = runtime_line(dataclasses.replace(cfg, global_resource_planner=planner))
    assert "re-planned online every 7 steps (replan_min_gain 25%)" in line
    assert "re-planned" not in runtime_line(cfg)


@pytest.mark.parametrize("drain", [True, False], ids=["drain", "abort"])
def test_runtime_line_of_an_elastic_rollout_pool(drain: bool) -> None:
    cfg = load_dict(gpu_base())
    planner = dataclasses.replace(cfg.global_resource_planner, runtime_dynamic_reconfiguration_enabled=True,
                                  runtime_rollout_reconfigure_strategy="restart_all",
                                  runtime_drain_before_reconfigure=drain)
    line = runtime_line(dataclasses.replace(cfg, global_resource_planner=planner))
    stop = "drained" if drain else "aborted, prompts requeued"
    assert f"reconfiguration on (the rollout pool is changed on request by restart_all; a serving instance it " \
           f"stops is {stop})" in line
    assert "requested but not implemented" not in line


def test_validate_refuses_replanning_without_reconfiguration_with_exit_2(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    import yaml

    data = gpu_base()
    data[GRP] = {**data[GRP], "runtime_online_replanning": True}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Invalid configuration" in err and "runtime_online_replanning" in err
