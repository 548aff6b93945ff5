"""Elastic hybrid parallelism planning: replica size (0 derives it), which rollout GPUs may be borrowed,
whether a lending server stays resident or sleeps, and the search pricing the training phase on the GPUs
lent to it."""

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
    planned_borrowed_dp,
    planned_borrowed_dp_each,
    replica_size_gpus,
)
from planner.layout import TrainLayout
from planner.memory import train_memory
from planner.search import brute_force, evaluate, search
from planner.workload import EhpOptions, PlannerInputError


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


def _inst(iid: str, *gpus: str, node: str = "", healthy: bool = True, lendable: bool = True) -> RolloutInstanceGpus:
    return RolloutInstanceGpus(iid, tuple(gpus), node=node, healthy=healthy, lendable=lendable)


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
    ("held-back-serves-and-counts", [_inst("r0", "0", lendable=False), *FOUR_TP1[1:]], 1, 1,
     [("1",), ("2",), ("3",)], ["r1", "r2", "r3"], 1, []),
    ("held-back-node-lends-nothing", [_inst("a", "0", node="n0", lendable=False), _inst("b", "1", node="n0"),
                                      _inst("c", "2", node="n1"), _inst("d", "3", node="n1")], 2, 0,
     [("2", "3")], ["c", "d"], 2, []),
    ("all-held-back", [_inst(f"r{i}", str(i), lendable=False) for i in range(2)], 1, 0, [], [], 2, []),
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
    assert not {i.instance_id for i in instances if not i.lendable} & set(plan.lent_instances)


def test_an_instance_held_back_says_so_when_nothing_is_lent() -> None:
    plan = plan_borrow([_inst("a", "0", lendable=False), _inst("b", "1", healthy=False)], 1, 0)
    assert not plan.replicas and plan.reason == "every healthy rollout instance is held back from lending"


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


# ---- the search prices the training phase on the GPUs EHP lends it -----------------------------------------
def _ehp(inp: object, keep: int = 0, size: int = 0) -> object:
    return replace(inp, ehp=EhpOptions(min_rollout_gpus=keep, replica_size_gpus=size))  # type: ignore[type-var]


BORROWED_CASES = {
    # name: (inputs changes, ehp (keep, size) or None, layout, rollout GPUs, rollout TP, borrowed DP ranks)
    "ehp-off": ({}, None, TrainLayout(), 6, 1, 0),
    "every-rollout-gpu": ({}, (0, 0), TrainLayout(), 6, 1, 6),
    "keep-two-serving": ({}, (2, 0), TrainLayout(), 6, 1, 4),
    "whole-instances-only": ({}, (1, 0), TrainLayout(), 6, 2, 4),  # 5 lendable GPUs: two TP-2 instances
    "replicas-of-the-layout": ({}, (0, 0), TrainLayout(tp=2), 6, 1, 3),
    "configured-replica-size": ({}, (0, 4), TrainLayout(tp=2), 6, 1, 2),  # one replica of 4 GPUs = 2 DP ranks
    "bad-replica-size-lends-nothing": ({}, (0, 3), TrainLayout(tp=2), 6, 1, 0),
    "asynchronous-job": ({"max_head_offpolicyness": 1}, (0, 0), TrainLayout(), 6, 1, 0),
    "fewer-than-a-replica": ({}, (5, 0), TrainLayout(tp=2), 6, 1, 0),
}


@pytest.mark.parametrize("case", BORROWED_CASES, ids=list(BORROWED_CASES))
def test_planned_borrowed_dp(case: str) -> None:
    changes, ehp, layout, rollout_gpus, rollout_tp, expected = BORROWED_CASES[case]
    inp = inputs(dense(), **changes)
    if ehp is not None:
        inp = _ehp(inp, *ehp)
    assert planned_borrowed_dp(inp, layout, rollout_gpus, rollout_tp) == expected  # type: ignore[arg-type]


def test_the_batch_form_checks_memory_once_per_distinct_borrow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vectorized search asks for many splits of one layout at once: each answer equals the single form's,
    and the memory estimate runs once per distinct (borrowed DP, rollout TP), not once per split."""
    import planner.ehp as ehp_module

    inp = _ehp(inputs(dense()), 1)
    rollout_gpus = [1, 2, 3, 3, 5, 5, 5, 7, 7]
    rollout_tp = [1, 1, 1, 1, 1, 2, 2, 1, 1]
    expected = [planned_borrowed_dp(inp, TrainLayout(), g, t)  # type: ignore[arg-type]
                for g, t in zip(rollout_gpus, rollout_tp, strict=True)]
    assert expected == [0, 1, 2, 2, 4, 4, 4, 6, 6]
    checked: list[tuple[int, int]] = []
    real = ehp_module.lent_gpu_residency

    def counting(inputs_: object, layout: TrainLayout, borrowed: int, tp: int) -> object:
        checked.append((borrowed, tp))
        return real(inputs_, layout, borrowed, tp)  # type: ignore[arg-type]

    monkeypatch.setattr(ehp_module, "lent_gpu_residency", counting)
    assert planned_borrowed_dp_each(inp, TrainLayout(), rollout_gpus, rollout_tp) == expected  # type: ignore[arg-type]
    assert checked == [(1, 1), (2, 1), (4, 1), (4, 2), (6, 1)]
    with pytest.raises(EhpPlanError, match="2 rollout sizes but 1 rollout TPs"):
        planned_borrowed_dp_each(inp, TrainLayout(), [1, 2], [1])  # type: ignore[arg-type]


def test_expert_parallel_layouts_borrow_nothing() -> None:
    inp = _ehp(inputs("qwen3-30b-a3b"))
    assert planned_borrowed_dp(inp, TrainLayout(ep=2), 4, 1) == 0  # type: ignore[arg-type]


def test_a_gpu_that_cannot_hold_a_borrowed_rank_is_not_lent() -> None:
    inp = _ehp(inputs("qwen2.5-32b"))  # a 32B training rank with no model parallelism fills an H100 alone
    layout = TrainLayout()
    assert lent_gpu_residency(inp, layout, 4, 1).decision == "no_fit"  # type: ignore[arg-type]
    assert planned_borrowed_dp(inp, layout, 4, 1) == 0  # type: ignore[arg-type]


EHP_SEARCH_CASES = {
    "7b-8gpu": dict(spec="qwen2.5-7b", nodes=1, allowed_pp=(1, 2)),
    "7b-16gpu-keep-4": dict(spec="qwen2.5-7b", nodes=2, allocation_granularity_gpus=2, allowed_pp=(1, 2), keep=4),
    "dense-8gpu-small": dict(spec="dense", nodes=1, allowed_pp=(1,)),
}


@pytest.mark.parametrize("case", EHP_SEARCH_CASES, ids=list(EHP_SEARCH_CASES))
def test_the_search_with_ehp_finds_the_brute_force_optimum(case: str) -> None:
    changes = dict(EHP_SEARCH_CASES[case])
    keep = int(changes.pop("keep", 0))  # type: ignore[call-overload]
    spec = dense() if changes["spec"] == "dense" else changes["spec"]
    changes.pop("spec")
    inp = _ehp(inputs(spec, **changes), keep)  # type: ignore[arg-type]
    plan = search(inp)  # type: ignore[arg-type]
    best, _ = brute_force(inp)  # type: ignore[arg-type]
    assert best is not None and plan.chosen is not None
    assert plan.chosen.candidate == best.candidate
    assert plan.chosen.samples_per_s == pytest.approx(best.samples_per_s, rel=1e-9)


def test_ehp_prices_the_training_phase_on_the_lent_gpus_and_moves_the_split_to_the_rollout() -> None:
    """Training every step on all the GPUs it borrows, a synchronous job gives the rollout pool more GPUs
    than when training runs on its own pool alone; the evaluation keeps the own pool's seconds beside."""
    plain = inputs("qwen2.5-7b", nodes=2, allowed_pp=(1,))
    lent = _ehp(plain)
    without, with_ehp = search(plain).chosen, search(lent).chosen  # type: ignore[arg-type]
    assert without is not None and with_ehp is not None
    assert with_ehp.candidate.rollout_gpus > without.candidate.rollout_gpus
    assert with_ehp.samples_per_s > without.samples_per_s
    borrowed = with_ehp.train["ehp_borrowed_dp"]
    assert borrowed == with_ehp.candidate.rollout_gpus // with_ehp.candidate.layout.model_parallel
    assert with_ehp.train["train_s"] < with_ehp.train["train_s_own"]
    own = evaluate(plain, with_ehp.candidate)
    assert own.train["train_s"] == pytest.approx(with_ehp.train["train_s_own"])
    assert own.train_memory.peak_bytes == with_ehp.train_memory.peak_bytes  # memory stays the own pool's


@pytest.mark.parametrize("field,value", [("min_rollout_gpus", -1), ("replica_size_gpus", -2)])
def test_bad_ehp_options_are_named(field: str, value: int) -> None:
    inp = replace(inputs(dense()), ehp=replace(EhpOptions(), **{field: value}))
    with pytest.raises(PlannerInputError, match=f"elastic_hybrid_{field}: {value}"):
        inp.validate()
