"""Weight alignment on resume: adopted servers that hold a newer publish version than the checkpoint make
the loop publish with an offset, and completions are mapped back to policy versions (fake pool edges)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from libra.config import load_dict
from libra.controller.desired_store import DesiredStore
from libra.controller.events import EventLog
from libra.controller.reporting import Reporter
from libra.controller.rl_loop import RLLoop, report_fields
from libra.controller.services import JobSession
from libra.controller.signals import StopRequest
from libra.controller.state import DesiredState, TrainLayout
from libra.observability.console import NullConsole
from libra.run_dir import RunDir


@dataclass
class FakeCompletion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


@dataclass
class FakeReport:
    total_s: float = 0.1
    slowest_instance: str = "rollout-0"
    slowest_total_s: float = 0.1
    acks_validated: int = 1
    method: str = "inplace"


class FakeRolloutPool:
    def __init__(self, version: int) -> None:
        self.version = version
        self.published: list[int] = []

    def publish_weights(self, version: int, hf_dir: str, checksum: str) -> FakeReport:
        if version < self.version:
            raise ValueError(f"version {version} < current {self.version}")
        self.version = version
        self.published.append(version)
        return FakeReport()

    async def generate(self, prompt_ids: list[int], **sampling: Any) -> list[FakeCompletion]:
        return [FakeCompletion([1], [-0.1], "stop", self.version)]


class FakeTrainingPool:
    def export_hf(self, out_dir: str) -> str:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        return "sha256t1:fake"


def fake_session(served: list[int]) -> tuple[JobSession, FakeRolloutPool]:
    """The RL loop's session on fake pools; the rollout servers hold the `served` weight versions."""
    rollout = FakeRolloutPool(max(served, default=0))
    store = DesiredStore(None, DesiredState(rollout_instances=1, rollout_tp=1, train_gpus=1, train_layout=TrainLayout()))
    session = JobSession(training=FakeTrainingPool(), generation=rollout, desired=store,  # type: ignore[arg-type]
                         publish_weights=rollout.publish_weights, served_versions=lambda: served,
                         wake_reconciler=lambda: None, pool_status=dict, pool_text=dict, tick_errors=lambda: 0)
    return session, rollout


class FakeTask:
    def train_prompts(self, seed: int) -> Any:
        while True:
            yield None


@pytest.mark.parametrize(
    ("served", "step", "published", "offset"),
    [
        pytest.param([0], 0, [], 0, id="fresh-servers-fresh-run"),
        pytest.param([0], 4, [4], 0, id="fresh-servers-resumed-run"),
        pytest.param([7], 4, [7], 3, id="adopted-newer-than-checkpoint"),
        pytest.param([3], 0, [3], 3, id="adopted-servers-restarted-run"),
        pytest.param([4], 4, [4], 0, id="adopted-at-checkpoint"),
    ],
)
def test_align_rollout_weights(tmp_path: Path, served: list[int], step: int, published: list[int],
                               offset: int) -> None:
    cfg = load_dict({"model_path": str(tmp_path / "m"), "rollout_kv_cache_bytes": 2**26,
                     "cluster": {"gpu_type": "cpu-logical", "logical_gpus": True, "gpus_per_node": 2},
                     "train_gpus": 1, "rollout_gpus": 1, "megatron_params_dtype": "fp32", "max_model_len": 256, "max_new_tokens": 4,
                     "megatron_use_cpu_initialization": True, "optimizer": {"clip_grad": 0},
                     "build_tiny_model": {"enabled": True, "num_heads": 2, "num_kv_heads": 1}})
    run = RunDir.at(tmp_path / "run").create()
    events = EventLog(run.events_jsonl)
    session, rollout = fake_session(served)
    loop = RLLoop(cfg, run, session, events, Reporter(run, "t", 10, NullConsole(), events, None), FakeTask(), None,
                  StopRequest(), 10)
    loop.state.step = step
    loop._make_producer()
    loop._align_rollout_weights(step)
    assert rollout.published == published
    assert session.desired.get().rollout_version_offset == offset
    assert loop.rollout_version == step and session.desired.get().weight_version == step
    completions = asyncio.run(loop._generate([1], n=1))
    assert completions[0].weight_version == step  # mapped back to the policy version


def test_report_fields() -> None:
    assert report_fields(FakeReport()) == {"reload_s": 0.1, "slowest_instance": "rollout-0",
                                           "slowest_instance_s": 0.1, "acks_validated": 1, "method": "inplace"}
    assert report_fields(object()) == {}
