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
    planner = dataclasses.replace(cfg.global_resource_planner, runtime_dynamic_reconfiguration_enabled=True,
                                  runtime_online_replanning=True)
    line = runtime_line(dataclasses.replace(cfg, global_resource_planner=planner))
    assert "reconfiguration on" not in line and "reconfiguration off" in line
    assert "requested but not implemented: runtime_dynamic_reconfiguration_enabled, runtime_online_replanning" in line


@pytest.mark.parametrize("option", ["runtime_dynamic_reconfiguration_enabled", "runtime_reconfigure_training"])
def test_validate_refuses_an_unwired_option_with_exit_2(option: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    import yaml

    data = gpu_base()
    data[GRP] = {**data[GRP], option: True}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Not implemented" in err and option in err
