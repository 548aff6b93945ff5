"""`libra simulate`: the comparison table, the JSON and the picture, scaling, and clear errors (exit 2)."""

from __future__ import annotations

import json
import os

import pytest

from libra.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLE = os.path.join(ROOT, "configs", "qwen2.5-7b-8gpu.yaml")


def test_simulate_prints_the_table_and_writes_json_and_picture(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "sim.json"
    code = main(["simulate", EXAMPLE, "--steps", "12", "--policy", "best_static", "--policy", "planner_initial",
                 "--policy", "elastic", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    for word in ("best_static", "planner_initial", "elastic", "samples/s", "vs best static"):
        assert word in printed
    document = json.loads(out.read_text())
    assert set(document["policies"]) == {"best_static", "planner_initial", "elastic"}
    assert len(document["policies"]["elastic"]["step_end_s"]) == 12
    assert len(document["mean_response_tokens"]) == 12
    picture = tmp_path / "sim.png"
    assert picture.read_bytes()[:4] == b"\x89PNG"


def test_the_runtimes_re_planner_is_a_policy_to_simulate(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`--policy online_replanning` replays Libra's runtime re-planner; its decisions are in the JSON."""
    from libra.cli.cmd_simulate import POLICY_CHOICES
    from planner.sim.policies import ALL_POLICIES

    assert POLICY_CHOICES == ALL_POLICIES  # the parser's copy of the simulator's names
    out = tmp_path / "sim.json"
    assert main(["simulate", EXAMPLE, "--steps", "30", "--policy", "planner_initial", "--policy",
                 "online_replanning", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "online_replanning" in printed and "re-planning decisions" in printed
    replayed = json.loads(out.read_text())["policies"]["online_replanning"]
    assert len(replayed["step_end_s"]) == 30
    judged = [d for d in replayed["decisions"] if "mean_response_tokens" in d]
    assert judged and all("undo" in d for d in judged)


def test_simulate_scales_the_job(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "scaled.json"
    assert main(["simulate", EXAMPLE, "--steps", "6", "--gpus", "64", "--policy", "planner_initial",
                 "--reload-method", "inplace", "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["gpus"] == 64 and document["reload_method"] == "inplace"


@pytest.mark.parametrize("extra, message", [
    pytest.param(["--gpus", "12"], "gpus: 12", id="gpus-not-whole-nodes"),
    pytest.param(["--end-mean", "999999"], "end_mean", id="mean-above-max-new-tokens"),
    pytest.param(["--ramp", "0"], "ramp: 0.0", id="ramp-not-positive"),
])
def test_bad_arguments_exit_2_with_the_field(extra: list[str], message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["simulate", EXAMPLE, "--steps", "4", "--policy", "planner_initial", *extra]) == 2
    assert message in capsys.readouterr().err


def test_invalid_configuration_exits_2(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_path: nowhere\nbatch_size: -1\n")
    assert main(["simulate", str(bad), "--steps", "2"]) == 2
    assert capsys.readouterr().err
