"""Elastic hybrid parallelism session, the parts that need no workers: how a global batch is shared between
the core pool and the borrowed worlds, the borrowed world's spec, the options it reads, and the attach
requests it refuses before starting anything."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from libra.cluster.ehp_workers import LentGpu
from libra.config.mapping import cpu_config, training_pool_spec
from libra.config.sections import PlannerConfig
from libra.metering.spec import CpuMetering
from libra.observability.phase_trace import TraceSettings
from libra.training.batching import dp_block
from libra.training.ehp import EhpError, EhpSession, EhpSettings, borrowed_spec, split_shares
from libra.training.spec import TrainingPoolSpec
from planner.layout import TrainLayout

SHARE_CASES = [
    # id, samples, core DP, borrowed world DPs -> [core, world...] blocks
    ("one-core-two-worlds", 8, 1, [1, 1], [(0, 3), (3, 6), (6, 8)]),
    ("one-core-one-world-dp2", 8, 1, [2], [(0, 3), (3, 8)]),
    ("even", 12, 2, [2], [(0, 6), (6, 12)]),
    ("too-few-samples-world-sits-out", 2, 1, [1, 1], [(0, 1), (1, 2), (2, 2)]),
    ("one-sample", 1, 2, [1], [(0, 1), (1, 1)]),
]


@pytest.mark.parametrize(("n", "core_dp", "worlds", "expected"),
                         [pytest.param(*c[1:], id=c[0]) for c in SHARE_CASES])
def test_split_shares(n: int, core_dp: int, worlds: list[int], expected: list[tuple[int, int]]) -> None:
    shares = split_shares(n, core_dp, worlds)
    assert shares == expected
    covered = [i for a, b in shares for i in range(a, b)]
    assert covered == list(range(n))  # every sample exactly once, in order
    # the same blocks a fixed pool of the joint DP size would give its ranks
    total = core_dp + sum(worlds)
    assert shares[0] == (0, dp_block(n, total, core_dp - 1)[1])


@pytest.mark.parametrize(("n", "core_dp", "worlds"), [
    pytest.param(0, 1, [1], id="no-samples"), pytest.param(4, 0, [1], id="core-dp-0"),
    pytest.param(4, 1, [0], id="world-dp-0"),
])
def test_split_shares_refuses(n: int, core_dp: int, worlds: list[int]) -> None:
    with pytest.raises(ValueError):
        split_shares(n, core_dp, worlds)


BASE = training_pool_spec(cpu_config("/m"), num_gpus=2)


def test_borrowed_spec_keeps_the_model_and_drops_optimizer_sharding_and_traces() -> None:
    core = replace(BASE, tp=2, trace=TraceSettings(enabled=True, directory="/tmp/x"),
                   megatron=replace(BASE.megatron, use_distributed_optimizer=True),
                   metering=CpuMetering(cores_per_gpu=0.5, job="j", cgroup_root=""))
    spec = borrowed_spec(core, 4)
    assert spec.num_gpus == 4 and spec.tp == 2 and spec.model_path == core.model_path
    assert spec.algorithm == core.algorithm and spec.optimizer == core.optimizer
    assert not spec.megatron.use_distributed_optimizer and spec.trace is None
    assert not spec.metering.enabled


def test_settings_from_the_planner_section() -> None:
    options = PlannerConfig(elastic_hybrid_replica_size_gpus=4, elastic_hybrid_min_rollout_gpus=2,
                                          decouple_communication_domains=True)
    assert EhpSettings.from_planner_options(options) == EhpSettings(4, 2, True)
    assert EhpSettings.from_planner_options(PlannerConfig()) == EhpSettings()


@dataclass
class _StoppedPool:
    """Just what `attach` reads before it starts anything."""

    spec: TrainingPoolSpec
    layout: TrainLayout
    name: str = "pool"


@pytest.mark.parametrize(("layout", "settings", "gpus", "message"), [
    pytest.param(TrainLayout(tp=2), EhpSettings(), 3, "not a positive multiple of the replica size 2", id="odd"),
    pytest.param(TrainLayout(), EhpSettings(), 0, "not a positive multiple", id="none"),
    pytest.param(TrainLayout(ep=2), EhpSettings(), 2, "expert parallelism", id="moe-ep"),
])
def test_attach_refuses(layout: TrainLayout, settings: EhpSettings, gpus: int, message: str) -> None:
    session = EhpSession(_StoppedPool(BASE, layout), settings)  # type: ignore[arg-type]
    with pytest.raises(EhpError, match=message):
        session.attach([LentGpu(str(i)) for i in range(gpus)])
    assert not session.attached


def test_attach_refuses_repeated_gpus() -> None:
    session = EhpSession(_StoppedPool(BASE, TrainLayout()), EhpSettings())  # type: ignore[arg-type]
    with pytest.raises(EhpError, match="repeat"):
        session.attach([LentGpu("1"), LentGpu("1")])


def test_a_rank_refuses_an_unknown_operation() -> None:
    from libra.training import ehp_steps

    with pytest.raises(ValueError, match="unknown elastic-hybrid operation 'nope'"):
        ehp_steps.run(object(), "nope")  # type: ignore[arg-type]
