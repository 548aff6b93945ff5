"""The pool specs the controller builds carry its tracer's settings, so both pools trace into the run's
trace directory exactly when the controller does."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.config import load_dict
from libra.controller.pools import rollout_spec, training_spec
from libra.controller.state import TrainLayout
from libra.observability.phase_trace import PhaseTracer, TraceSettings
from libra.run_dir import RunDir

JOB = {
    "model_path": "/tmp/libra-unit-tiny-model", "rollout_kv_cache_bytes": 2**26,
    "cluster": {"gpu_type": "cpu-logical", "logical_gpus": True, "gpus_per_node": 2},
    "train_gpus": 1, "rollout_gpus": 1, "megatron_params_dtype": "fp32", "max_model_len": 256,
    "max_new_tokens": 4, "megatron_use_cpu_initialization": True, "optimizer": {"clip_grad": 0},
    "build_tiny_model": {"enabled": True, "num_heads": 2, "num_kv_heads": 1},
}


@pytest.mark.parametrize("enabled", [True, False], ids=["tracing", "no-tracing"])
def test_both_specs_carry_the_controller_trace_settings(tmp_path: Path, enabled: bool) -> None:
    cfg, run = load_dict(JOB), RunDir.at(tmp_path / "run")
    tracer = PhaseTracer.open(run.root, role="controller", rank=0, enabled=enabled, env={})
    try:
        settings = tracer.settings()
        rollout = rollout_spec(cfg, run, 1, settings)
        train = training_spec(cfg, run, 1, TrainLayout(), settings)
    finally:
        tracer.close()
    expected = TraceSettings(True, str(run.root / "traces")) if enabled else TraceSettings(False, None)
    assert rollout.trace == train.trace == expected


def test_specs_trace_nothing_by_default(tmp_path: Path) -> None:
    cfg, run = load_dict(JOB), RunDir.at(tmp_path / "run")
    assert rollout_spec(cfg, run, 1).trace is None
    assert training_spec(cfg, run, 1, TrainLayout()).trace is None


def test_launch_fingerprint_changes_with_tp_and_settings(tmp_path: Path) -> None:
    from libra.controller.pools import rollout_fingerprint

    run = RunDir.at(tmp_path / "run")
    cfg = load_dict(JOB)
    assert rollout_fingerprint(cfg, run, 1) == rollout_fingerprint(load_dict(JOB), run, 1)
    assert rollout_fingerprint(cfg, run, 1) != rollout_fingerprint(cfg, run, 2)
    assert rollout_fingerprint(cfg, run, 1) != rollout_fingerprint(load_dict(JOB | {"max_model_len": 512}), run, 1)


@pytest.mark.parametrize(
    ("state", "healthy", "failure", "expected", "error"),
    [
        pytest.param("ready", True, "", "READY", "", id="ready"),
        pytest.param("starting", True, "", "STARTING", "", id="starting"),
        pytest.param("ready", False, "", "FAILED", "instance reported unhealthy (state ready)", id="unhealthy"),
        pytest.param("failed", False, "its host is gone", "FAILED", "its host is gone", id="failed-says-why"),
    ],
)
def test_instance_view_carries_spec_placement_and_routing(state: str, healthy: bool, failure: str, expected: str,
                                                          error: str) -> None:
    from libra.controller.pools import instance_view
    from libra.rollout.spec import InstanceInfo

    info = InstanceInfo(id="rollout-3", host="127.0.0.1", port=8000, pid=42, gpu_ids=("0", "1"), weight_version=5,
                        state=state, healthy=healthy, tp_size=2, fingerprint="is-abc", serving=True, failure=failure)
    view = instance_view(info)
    assert (view.key, view.state.value, view.tp, view.gpu_ids, view.fingerprint, view.serving, view.weight_version) == (
        "rollout-3", expected, 2, ("0", "1"), "is-abc", True, 5)
    assert view.error == error
