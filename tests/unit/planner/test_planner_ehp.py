"""Elastic hybrid parallelism planning: replica size (0 derives it), which rollout GPUs may be borrowed, and
whether a lending server stays resident or sleeps."""

from __future__ import annotations

from dataclasses import replace

import pytest
from planner_cases import dense, inputs

from planner.ehp import (
    EhpPlanError,
    RolloutInstanceGpus,
    borrowed_rank_memory,
    lent_gpu_residency,
    plan_borrow,
    replica_size_gpus,
)
from planner.layout import TrainLayout
from planner.memory import train_memory


@pytest.mark.parametrize(("configured", "layout", "expected"), [
    pytest.param(0, TrainLayout(), 1, id="derived-tp1"),
    pytest.param(0, TrainLayout(tp=2), 2, id="derived-tp2"),
    pytest.param(0, TrainLayout(tp=2, pp=2), 4, id="derived-tp2-pp2"),
    pytest.param(0, TrainLayout(tp=2, cp=2), 4, id="derived-tp2-cp2"),
    pytest.param(0, TrainLayout(tp=2, ep=4), 8, id="derived-moe-ep4"),
    pytest.param(4, TrainLayout(tp=2), 4, id="configured-multiple"),
    pytest.param(2, TrainLayout(tp=2), 2, id="configured-unit"),
])
def test_replica_size(configured: int, layout: TrainLayout, expected: int) -> None:
    assert replica_size_gpus(configured, layout) == expected


@pytest.mark.parametrize(("configured", "layout", "message"), [
    pytest.param(3, TrainLayout(tp=2), "multiple of 2", id="not-a-multiple"),
    pytest.param(2, TrainLayout(tp=2, pp=2), "multiple of 4", id="smaller-than-a-replica"),
    pytest.param(-1, TrainLayout(), "must be >= 0", id="negative"),
])
def test_replica_size_refused(configured: int, layout: TrainLayout, message: str) -> None:
    with pytest.raises(EhpPlanError, match=message) as err:
        replica_size_gpus(configured, layout)
    assert "elastic_hybrid_replica_size_gpus" in str(err.value)


def _inst(iid: str, *gpus: str, node: str = "", healthy: bool = True) -> RolloutInstanceGpus:
    return RolloutInstanceGpus(iid, tuple(gpus), node=node, healthy=healthy)


FOUR_TP1 = [_inst(f"r{i}", str(i)) for i in range(4)]
BORROW_CASES = [
    # id, instances, replica size, min rollout GPUs -> replicas, lent instances, serving GPUs, idle GPUs
    ("all-lent", FOUR_TP1, 1, 0, [("0",), ("1",), ("2",), ("3",)], ["r0", "r1", "r2", "r3"], 0, []),
    ("keep-one-serving", FOUR_TP1, 1, 1, [("0",), ("1",), ("2",)], ["r0", "r1", "r2"], 1, []),
    ("keep-everything", FOUR_TP1, 1, 4, [], [], 4, []),
    ("replica-of-two", FOUR_TP1, 2, 0, [("0", "1"), ("2", "3")], ["r0", "r1", "r2", "r3"], 0, []),
    ("replica-of-two-keep-one", FOUR_TP1, 2, 1, [("0", "1")], ["r0", "r1"], 2, []),
    ("budget-below-one-replica", FOUR_TP1, 4, 1, [], [], 4, []),
    ("tp2-instances-split-into-replicas", [_inst("a", "0", "1"), _inst("b", "2", "3")], 1, 2,
     [("0",), ("1",)], ["a"], 2, []),
    ("instance-lent-whole-idle-gpu", [_inst("a", "0", "1", "2"), _inst("b", "3", "4", "5")], 2, 3,
     [("0", "1")], ["a"], 3, ["2"]),
    ("replica-spans-two-instances", [_inst("a", "0", "1", "2"), _inst("b", "3", "4", "5")], 2, 0,
     [("0", "1"), ("2", "3"), ("4", "5")], ["a", "b"], 0, []),
    ("unhealthy-never-lent-nor-counted", [_inst("r0", "0", healthy=False), *FOUR_TP1[1:]], 1, 1,
     [("1",), ("2",)], ["r1", "r2"], 1, []),
    ("replica-stays-on-one-node", [_inst("a", "0", node="n0"), _inst("b", "1", node="n1"),
                                   _inst("c", "2", node="n0"), _inst("d", "3", node="n1")], 2, 0,
     [("0", "2"), ("1", "3")], ["a", "c", "b", "d"], 0, []),
    ("lone-gpu-on-a-node-not-lent", [_inst("a", "0", node="n0"), _inst("b", "1", node="n1"),
                                     _inst("c", "2", node="n1")], 2, 0,
     [("1", "2")], ["b", "c"], 1, []),
    ("no-instances", [], 1, 0, [], [], 0, []),
]


@pytest.mark.parametrize(("instances", "size", "keep", "replicas", "lent", "serving_gpus", "idle"),
                         [pytest.param(*case[1:], id=case[0]) for case in BORROW_CASES])
def test_plan_borrow(instances: list[RolloutInstanceGpus], size: int, keep: int, replicas: list[tuple[str, ...]],
                     lent: list[str], serving_gpus: int, idle: list[str]) -> None:
    plan = plan_borrow(instances, size, keep)
    assert list(plan.replicas) == replicas
    assert list(plan.lent_instances) == lent
    assert plan.serving_gpus == serving_gpus
    assert plan.serving_gpus >= keep or not replicas
    assert list(plan.idle_gpu_ids) == idle
    assert set(plan.serving_instances) == {i.instance_id for i in instances if i.healthy} - set(lent)
    assert all(len(r) == size for r in plan.replicas)
    assert plan.reason


def test_replica_owners_name_each_gpu_where_ids_repeat_across_nodes() -> None:
    """GPU ids are per node: two nodes both have a GPU "0" and "1"; each replica GPU is named with its instance."""
    instances = [_inst("a", "0", node="n0"), _inst("b", "1", node="n0"), _inst("c", "0", node="n1"),
                 _inst("d", "1", node="n1")]
    plan = plan_borrow(instances, 2, 0)
    assert list(plan.replicas) == [("0", "1"), ("0", "1")]
    assert list(plan.replica_owners) == [("a", "b"), ("c", "d")]
    single = plan_borrow(FOUR_TP1, 1, 1)
    assert [len(o) for o in single.replica_owners] == [len(r) for r in single.replicas]
    assert {o for owners in single.replica_owners for o in owners} == set(single.lent_instances)


@pytest.mark.parametrize(("instances", "size", "keep", "message"), [
    pytest.param([_inst("a", "0"), _inst("a", "1")], 1, 0, "more than once", id="duplicate-instance"),
    pytest.param([_inst("a")], 1, 0, "lists no GPUs", id="no-gpus"),
    pytest.param(FOUR_TP1, 0, 0, "replica_size=0", id="zero-replica"),
    pytest.param(FOUR_TP1, 1, -1, "elastic_hybrid_min_rollout_gpus=-1", id="negative-keep"),
])
def test_plan_borrow_refuses_bad_input(instances: list[RolloutInstanceGpus], size: int, keep: int,
                                       message: str) -> None:
    with pytest.raises(EhpPlanError, match=message):
        plan_borrow(instances, size, keep)


GIB = 2**30


def _with_kv(kv_bytes: int, model: object = "qwen2.5-7b") -> object:
    inp = inputs(model)  # type: ignore[arg-type]
    return replace(inp, rollout=replace(inp.rollout, kv_cache_bytes=kv_bytes))


@pytest.mark.parametrize(("inp", "layout", "decision"), [
    # a 7B training rank at TP1 (about 98 GiB) fits no 80 GB GPU, asleep or not
    pytest.param(_with_kv(0), TrainLayout(), "no_fit", id="7b-tp1-no-fit"),
    # at TP2 (about 49 GiB) it fits only once the server frees the KV cache that fills 90% of the GPU
    pytest.param(_with_kv(0), TrainLayout(tp=2), "sleep", id="7b-tp2-kv-fills-gpu-sleep"),
    # a 4 GiB KV cache leaves room: the server stays resident
    pytest.param(_with_kv(4 * GIB), TrainLayout(tp=2), "resident", id="7b-tp2-small-kv-resident"),
    pytest.param(_with_kv(0, dense()), TrainLayout(), "resident", id="small-model-resident"),
])
def test_lent_gpu_residency(inp: object, layout: TrainLayout, decision: str) -> None:
    result = lent_gpu_residency(inp, layout, borrowed_dp=1, rollout_tp=1)  # type: ignore[arg-type]
    assert result.decision == decision
    fits_awake = result.train_rank_bytes + result.server_resident_bytes <= result.capacity_bytes
    fits_asleep = result.train_rank_bytes + result.server_sleeping_bytes <= result.capacity_bytes
    assert decision == ("resident" if fits_awake else "sleep" if fits_asleep else "no_fit")
    assert result.server_sleeping_bytes < result.server_resident_bytes
    assert decision in result.explain()


def test_borrowed_rank_holds_no_optimizer_state() -> None:
    inp = inputs("qwen2.5-7b")
    full = train_memory(inp, TrainLayout(tp=2), 1)
    borrowed = borrowed_rank_memory(inp, TrainLayout(tp=2), 1)
    names = {t.name for t in borrowed.terms}
    assert "optimizer_state" in {t.name for t in full.terms} and "optimizer_state" not in names
    # bf16 training: Megatron's optimizer keeps an fp32 main copy (4 B per parameter, twice the bf16 weights)
    assert borrowed.term("main_params").bytes == 2 * borrowed.term("weights").bytes
    assert borrowed.peak_bytes < full.peak_bytes


def test_residency_refuses_bad_input() -> None:
    with pytest.raises(EhpPlanError, match="rollout_tp=0"):
        lent_gpu_residency(inputs(dense()), TrainLayout(), 1, 0)
    with pytest.raises(EhpPlanError, match="borrowed_dp=0"):
        lent_gpu_residency(inputs(dense()), TrainLayout(), 0, 1)
