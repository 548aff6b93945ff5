"""Creating the rollout pool keeps what runs when one start fails: a controller restarted mid-switch adopts the
instance that serves and must not discard it because the start of another instance failed (that member is
reported failed and replaced later). Only a pool left with no instance at all is a failed creation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import libra.rollout.pool
from libra.config import load_dict
from libra.controller.members import MemberState
from libra.controller.pools import RolloutPoolEdge
from libra.controller.state import RolloutSpec
from libra.run_dir import RunDir

JOB = {
    "model_path": "/tmp/libra-unit-tiny-model", "rollout_kv_cache_bytes": 2**26,
    "cluster": {"gpu_type": "cpu-logical", "logical_gpus": True, "gpus_per_node": 4},
    "train_gpus": 1, "rollout_gpus": 2, "megatron_params_dtype": "fp32", "max_model_len": 256,
    "max_new_tokens": 4, "megatron_use_cpu_initialization": True, "optimizer": {"clip_grad": 0},
    "build_tiny_model": {"enabled": True, "num_heads": 2, "num_kv_heads": 1},
}


@dataclass
class FakeInfo:
    instance_id: str
    weight_version: int = 0
    state: str = "ready"
    tp_size: int = 1

    @property
    def id(self) -> str:
        return self.instance_id


@dataclass
class FakeLive:
    instance_id: str
    tp_size: int
    fingerprint: str
    in_pool: bool = False


class FakeRolloutPool:
    """A managed rollout pool whose listed instance ids fail to start; `live` are servers left running."""

    failing: set[str] = set()
    live: list[str] = []
    shut_down: list[bool] = []

    def __init__(self, runtime: Any, spec: Any) -> None:
        self.spec = spec
        self.weight_version = 0
        self.running: dict[str, FakeInfo] = {}
        self.serving: list[str] = []

    def open(self) -> None:
        pass

    def live_servers(self) -> list[FakeLive]:
        launch = self.spec.instance_spec(1)
        return [FakeLive(i, 1, launch.fingerprint()) for i in self.live]

    def start_instance(self, instance_id: str, launch: Any) -> FakeInfo:
        if instance_id in self.failing:
            raise RuntimeError(f"port of {instance_id} is still in use")
        self.running[instance_id] = FakeInfo(instance_id)
        return self.running[instance_id]

    def stop_instance(self, instance_id: str, drain: bool) -> None:
        self.running.pop(instance_id, None)

    def instances(self) -> list[FakeInfo]:
        return list(self.running.values())

    def set_serving(self, ids: list[str]) -> None:
        self.serving = list(ids)

    def shutdown(self, keep_servers: bool = False) -> None:
        FakeRolloutPool.shut_down.append(keep_servers)


@pytest.mark.parametrize(
    ("live", "failing", "expected_states", "serving"),
    [
        (["rollout-0"], {"rollout-1"}, {"rollout-0": MemberState.READY, "rollout-1": MemberState.FAILED},
         ["rollout-0"]),
        ([], {"rollout-1"}, {"rollout-0": MemberState.READY, "rollout-1": MemberState.FAILED}, ["rollout-0"]),
        ([], set(), {"rollout-0": MemberState.READY, "rollout-1": MemberState.READY}, ["rollout-0", "rollout-1"]),
    ],
    ids=["adopted-kept-when-a-start-fails", "started-kept-when-another-fails", "all-start"],
)
def test_create_keeps_the_instances_that_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, live: list[str],
                                             failing: set[str], expected_states: dict[str, MemberState],
                                             serving: list[str]) -> None:
    monkeypatch.setattr(libra.rollout.pool, "RolloutPool", FakeRolloutPool)
    monkeypatch.setattr(FakeRolloutPool, "live", live)
    monkeypatch.setattr(FakeRolloutPool, "failing", failing)
    monkeypatch.setattr(FakeRolloutPool, "shut_down", [])
    edge = RolloutPoolEdge(load_dict(JOB), RunDir.at(tmp_path / "run"), runtime=None)
    views = edge.create(["rollout-0", "rollout-1"], RolloutSpec(1))
    assert {v.key: v.state for v in views} == expected_states
    for view in views:
        if view.state is MemberState.FAILED:
            assert "start failed: RuntimeError: port of" in view.error
    assert edge.pool.serving == serving
    assert FakeRolloutPool.shut_down == []


def test_create_with_no_instance_running_fails_and_shuts_the_pool(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.setattr(libra.rollout.pool, "RolloutPool", FakeRolloutPool)
    monkeypatch.setattr(FakeRolloutPool, "live", [])
    monkeypatch.setattr(FakeRolloutPool, "failing", {"rollout-0", "rollout-1"})
    monkeypatch.setattr(FakeRolloutPool, "shut_down", [])
    edge = RolloutPoolEdge(load_dict(JOB), RunDir.at(tmp_path / "run"), runtime=None)
    with pytest.raises(RuntimeError, match="port of rollout-0 is still in use"):
        edge.create(["rollout-0", "rollout-1"], RolloutSpec(1))
    assert edge.pool is None and FakeRolloutPool.shut_down == [False]
