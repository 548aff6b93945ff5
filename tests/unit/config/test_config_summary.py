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


def test_requested_elastic_options_are_named_not_reported_on() -> None:
    """Even on a configuration that skipped validation, a requested elastic option is not reported as active."""
    cfg = load_dict(gpu_base())
    planner = dataclasses.replace(cfg.global_resource_planner, runtime_online_replanning=True,
                                  replan_min_gain=0.5)
    line = runtime_line(dataclasses.replace(cfg, global_resource_planner=planner))
    assert "reconfiguration on" not in line and "reconfiguration off" in line
    assert "requested but not implemented: runtime_online_replanning, replan_min_gain" in line


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


@pytest.mark.parametrize("option", ["runtime_online_replanning"])
def test_validate_refuses_an_unwired_option_with_exit_2(option: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    import yaml

    data = gpu_base()
    data[GRP] = {**data[GRP], option: True}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Not implemented" in err and option in err


@pytest.mark.parametrize(("strategy", "enabled", "train", "rollout", "note"), [
    ("blue_green", True, 8, 8, "blue_green falls back to diff: train 8 + rollout 8 of 16 GPUs leaves 0 spare"),
    ("prewarm", True, 8, 8, "prewarm falls back to diff: train 8 + rollout 8 of 16 GPUs leaves 0 spare"),
    ("blue_green", True, 8, 6, "blue_green falls back to diff for a target of more than 2 instance(s) of TP1: "
                               "train 8 + rollout 6 of 16 GPUs leaves 2 spare GPUs"),
    ("blue_green", True, 0, 0, "blue_green falls back to diff if the planner's split leaves fewer spare GPUs"),
    ("blue_green", True, 8, 4, ""),  # the 4 spare GPUs hold a green set of the same size
    ("diff", True, 8, 8, ""),
    ("restart_all", True, 8, 8, ""),
    ("blue_green", False, 8, 8, ""),  # no reconfiguration, no strategy
], ids=["blue_green-no-spare", "prewarm-no-spare", "blue_green-some-spare", "planner-split", "blue_green-fits",
        "diff", "restart_all", "reconfiguration-off"])
def test_runtime_line_says_when_the_strategy_falls_back_to_diff(strategy: str, enabled: bool, train: int,
                                                                 rollout: int, note: str) -> None:
    cfg = load_dict(gpu_base())
    planner = dataclasses.replace(cfg.global_resource_planner, runtime_dynamic_reconfiguration_enabled=enabled,
                                  runtime_rollout_reconfigure_strategy=strategy)
    line = runtime_line(dataclasses.replace(cfg, global_resource_planner=planner, train_gpus=train,
                                            rollout_gpus=rollout))
    if note:
        assert note in line
    else:
        assert "falls back" not in line


def test_validate_prints_the_fallback_of_blue_green_without_spare_gpus(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    import yaml

    data = gpu_base()
    data[GRP] = {**data[GRP], "runtime_dynamic_reconfiguration_enabled": True,
                 "runtime_rollout_reconfigure_strategy": "blue_green"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "blue_green falls back to diff: train 8 + rollout 8 of 16 GPUs leaves 0 spare" in out, out
