"""Which candidate the planner picks and what it says about it: the tie-break on throughput (memory headroom,
then fewer training GPUs), advice on the phase that dominates the step (each figure a re-run of the search),
the numbers `Pruned` carries, and the module structure (search and advice without an import cycle)."""

from __future__ import annotations

import ast
import os
from dataclasses import replace

import numpy as np
import pytest
from planner_cases import ROOT, inputs

from libra.config import load
from libra.planning import plan_job
from planner.advice import DOMINANT_SHARE, EHP_SETTING
from planner.grp import plan
from planner.layout import TrainLayout
from planner.memory import MemoryEstimate, MemoryTerm
from planner.plan import THROUGHPUT_TIE_TOLERANCE, Candidate, Evaluation, in_tie, rank
from planner.report import plan_dict
from planner.search import brute_force, evaluate, preferred_order, search
from planner.workload import EhpOptions, PlannerInputs, RolloutOptions

GB = 10**9


def _ev(samples_per_s: float, peak_gb: float, train_gpus: int = 8, tp: int = 1) -> Evaluation:
    memory = MemoryEstimate((MemoryTerm("weights", "static", int(peak_gb * GB)),), 80 * GB)
    return Evaluation(candidate=Candidate(train_gpus, 16 - train_gpus, TrainLayout(tp=tp), 1), train_memory=memory,
                      rollout_memory=memory, train={"train_s": 1.0, "logprob_recompute_s": 0.0},
                      rollout={"generation_s": 1.0, "weight_sync_s": 0.0}, step_s=1.0 / samples_per_s,
                      samples_per_s=samples_per_s, tokens_per_s=0.0, kv_capacity_sequences=1)


# (id, candidates as (samples/s, train peak GB, train GPUs, tp), expected order as indices)
TIE_CASES = [
    ("tie-more-headroom-wins", [(10.0, 70, 8, 1), (9.96, 20, 8, 2)], [1, 0]),
    ("beyond-tolerance-throughput-wins", [(10.0, 70, 8, 1), (9.90, 20, 8, 2)], [0, 1]),
    ("same-headroom-fewer-gpus", [(10.0, 40, 12, 1), (10.0, 40, 8, 1)], [1, 0]),
    ("headroom-below-a-megabyte-is-equal", [(10.0, 40.0000001, 12, 1), (9.99, 40, 8, 1)], [1, 0]),
    ("headroom-before-gpus", [(10.0, 30, 12, 1), (10.0, 40, 8, 1)], [0, 1]),
    ("exact-tie-higher-throughput", [(9.99, 40, 8, 2), (10.0, 40, 8, 1)], [1, 0]),
    ("tolerance-is-not-chained", [(10.0, 70, 8, 1), (9.96, 60, 8, 2), (9.92, 10, 8, 4)], [1, 0, 2]),
]


@pytest.mark.parametrize(("cases", "expected"), [c[1:] for c in TIE_CASES], ids=[c[0] for c in TIE_CASES])
def test_rank_breaks_throughput_ties_by_headroom_then_gpus(cases: list[tuple[float, float, int, int]],
                                                           expected: list[int]) -> None:
    evs = [_ev(*c) for c in cases]
    assert [evs.index(e) for e in rank(evs)] == expected


def test_tie_tolerance_is_half_a_percent() -> None:
    assert THROUGHPUT_TIE_TOLERANCE == 0.005
    assert in_tie(9.951, 10.0) and not in_tie(9.949, 10.0)


@pytest.mark.parametrize("seed", range(5))
def test_array_order_is_the_rank_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 40
    samples = 10.0 * (1.0 - rng.choice([0.0, 0.002, 0.004, 0.006, 0.02], n))
    peaks = rng.choice([20.0, 40.0, 60.0], n)
    gpus = rng.choice([4, 8, 12], n)
    evs = [_ev(float(s), float(p), int(g), tp=1 + i) for i, (s, p, g) in enumerate(zip(samples, peaks, gpus, strict=True))]
    headroom = np.array([e.train_memory.headroom_bytes // 10**6 for e in evs], dtype=float)
    tp = np.array([e.candidate.layout.tp for e in evs])
    side = np.ones(n)
    order = preferred_order(samples, (tp, side, -samples, gpus, -headroom), n)
    assert [evs[k] for k in order] == rank(evs)


QWEN3_64 = os.path.join(ROOT, "configs", "qwen3-30b-a3b-64gpu.yaml")


def test_64_gpu_moe_example_picks_the_most_headroom_among_equal_throughput() -> None:
    job = plan_job(load(QWEN3_64))
    assert job.feasible and job.chosen is not None
    best = job.chosen
    tied = [a for a in job.alternatives if in_tie(a.samples_per_s, best.samples_per_s)]
    assert tied, "the example has several layouts of equal throughput (the rollout side sets the step)"
    assert all(best.train_memory.headroom_bytes >= a.train_memory.headroom_bytes for a in tied)
    ranked = [best, *job.alternatives]
    assert rank(ranked) == ranked


@pytest.mark.parametrize("case", ["7b-16gpu-sync", "moe-16gpu-async"])
def test_search_choice_is_the_best_of_every_candidate(case: str) -> None:
    inp = {"7b-16gpu-sync": inputs("qwen2.5-7b", nodes=2, allocation_granularity_gpus=4, allowed_pp=(1, 2, 4)),
           "moe-16gpu-async": inputs("qwen3-30b-a3b", nodes=2, allocation_granularity_gpus=8, allowed_pp=(1, 2),
                                     max_head_offpolicyness=2, ep_comm_compute_ratio_threshold=5.0)}[case]
    best, _ = brute_force(inp)
    found = search(inp)
    assert best is not None and found.chosen is not None
    assert found.chosen.candidate == best.candidate
    s = inp.space
    everything = [evaluate(inp, Candidate(t, inp.cluster.total_gpus - t, lay, r))
                  for t in found.splits for lay in {e.candidate.layout for e in [best, *found.alternatives]}
                  for r in s.allowed_rollout_tp]
    tied = [e for e in everything if e.feasible and in_tie(e.samples_per_s, best.samples_per_s)]
    assert max(e.train_memory.headroom_bytes // 10**6 for e in tied) == best.train_memory.headroom_bytes // 10**6


# ------------------------------------------------------------------------------------------- phase advice
def _restart(inp: PlannerInputs) -> PlannerInputs:
    return replace(inp, rollout=RolloutOptions(reload_method="restart"))


def _inplace(inp: PlannerInputs) -> PlannerInputs:
    return replace(inp, rollout=RolloutOptions(reload_method="inplace"))


# (id, inputs, the options advised and the dominating phase each is advised for)
PHASE_CASES = [
    ("7b-16gpu-restart-sync", _restart(inputs("qwen2.5-7b", nodes=2)),
     {"rollout_weight_reload_method: inplace": "weight_sync",
      "sync_interval: 2 with max_head_offpolicyness: 1": "weight_sync", "max_head_offpolicyness: 1": "weight_sync"}),
    ("7b-16gpu-inplace-sync", _inplace(inputs("qwen2.5-7b", nodes=2, max_new_tokens=3072)),
     {"max_head_offpolicyness: 1": "generation", EHP_SETTING: "train"}),
    ("7b-16gpu-full-recompute-async", _inplace(inputs("qwen2.5-7b", nodes=2, max_head_offpolicyness=1,
                                                      recompute_granularity="full")),
     {"megatron_recompute_granularity: none": "train"}),
]


@pytest.mark.parametrize(("inp", "options"), [c[1:] for c in PHASE_CASES], ids=[c[0] for c in PHASE_CASES])
def test_dominating_phase_gets_options_with_predicted_figures(inp: PlannerInputs, options: dict[str, str]) -> None:
    job = plan(inp)
    assert job.chosen is not None
    advised = {a.option: a for a in job.phase_advice}
    assert set(advised) == set(options)
    for option, a in advised.items():
        phase = options[option]
        assert job.chosen.phases[phase] / job.chosen.step_s > DOMINANT_SHARE
        assert a.phase == phase and a.gain > 0
        assert a.phase_s == job.chosen.phases[phase] and a.step_s == job.chosen.step_s


def test_elastic_hybrid_advice_is_the_search_rerun_with_ehp_on_and_a_rollout_heavy_split() -> None:
    """A synchronous job whose training dominates: the advice to turn EHP on carries the search re-run with the
    training phase priced on the GPUs the rollout pool lends, which gives the rollout pool more GPUs; a job
    with EHP on, or an asynchronous one, gets no such advice."""
    inp = _inplace(inputs("qwen2.5-7b", nodes=2, max_new_tokens=3072))
    job = plan(inp)
    advice = {a.option: a for a in job.phase_advice}[EHP_SETTING]
    rerun = search(replace(inp, ehp=EhpOptions())).chosen
    assert rerun is not None and job.chosen is not None
    assert (advice.new_step_s, advice.new_split) == (rerun.step_s, rerun.candidate.label())
    assert rerun.candidate.rollout_gpus > job.chosen.candidate.rollout_gpus
    assert advice.new_phase_s < advice.phase_s
    lending = plan(replace(inp, ehp=EhpOptions()))
    asynchronous = plan(replace(inp, workload=replace(inp.workload, max_head_offpolicyness=1)))
    assert EHP_SETTING not in {a.option for a in lending.phase_advice + asynchronous.phase_advice}


def test_phase_advice_figures_are_the_search_rerun_with_the_option() -> None:
    inp = _restart(inputs("qwen2.5-7b", nodes=2))
    job = plan(inp)
    advice = {a.option: a for a in job.phase_advice}["rollout_weight_reload_method: inplace"]
    rerun = search(_inplace(inp)).chosen
    assert rerun is not None
    assert advice.new_phase_s == rerun.phases["weight_sync"] < advice.phase_s / 5
    assert advice.new_step_s == rerun.step_s
    assert advice.gain == pytest.approx(rerun.samples_per_s / job.chosen.samples_per_s - 1)  # type: ignore[union-attr]
    doc = plan_dict(job)
    assert {"phase": "weight_sync", "option": "rollout_weight_reload_method: inplace"}.items() <= \
        doc["phase_advice"][[d["option"] for d in doc["phase_advice"]].index(advice.option)].items()


def test_no_phase_advice_when_no_option_helps() -> None:
    job = plan(_inplace(inputs("qwen2.5-7b", nodes=2, max_head_offpolicyness=1)))
    assert job.feasible and job.phase_advice == []


def test_plan_cli_prints_the_advice_for_7b_on_16_h100_without_a_reload_method() -> None:
    from io import StringIO

    from rich.console import Console

    from libra.cli.cmd_plan import render

    cfg_path = os.path.join(ROOT, "configs", "qwen2.5-7b-8gpu.yaml")
    cfg = load(cfg_path, ["cluster.num_nodes=2", "rollout_weight_reload_method=restart", "max_head_offpolicyness=0"])
    job = plan_job(cfg)
    out = StringIO()
    render(job, Console(file=out, width=200, highlight=False), cfg_path, explain=False)
    text = out.getvalue()
    assert "weight sync takes" in text and "rollout_weight_reload_method: inplace" in text


# ------------------------------------------------------------------------------------ pruned numbers, imports
def test_pruned_carries_the_smallest_value_and_the_threshold() -> None:
    inp = inputs("qwen2.5-7b", nodes=2, allocation_granularity_gpus=2, bubble_ratio_threshold=0.01,
                 allowed_pp=(1, 2, 4))
    job = search(inp)
    bubbles = [p for p in job.pruned if p.code == "bubble_ratio"]
    assert bubbles
    for p in bubbles:
        assert p.layout is not None and p.threshold == 0.01
        ratios = [evaluate(inp, Candidate(t, inp.cluster.total_gpus - t, p.layout, 1)).train["bubble_ratio"]
                  for t in (p.train_gpus or job.splits)]
        assert p.value is not None and p.value == pytest.approx(min(ratios)) and p.value > p.threshold
    memory = [p for p in job.pruned if p.code == "train_memory"]
    assert memory
    for p in memory:
        assert p.value is not None and p.threshold is not None and p.value > p.threshold == inp.cluster.gpu.memory_bytes


def _planner_imports(path: str) -> set[str]:
    tree = ast.parse(open(path).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("planner"):
            found.add(node.module if node.module != "planner" else f"planner.{node.names[0].name}")
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("planner"))
    return found


def test_planner_modules_import_each_other_without_a_cycle() -> None:
    folder = os.path.join(ROOT, "planner")
    graph = {f"planner.{name[:-3]}": _planner_imports(os.path.join(folder, name))
             for name in os.listdir(folder) if name.endswith(".py") and name != "__init__.py"}
    assert "planner.advice" not in graph["planner.search"]

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    assert [m for m in graph if reaches(m, m, set())] == []


def test_raised_threshold_advice_uses_the_pruned_numbers() -> None:
    inp = inputs("qwen2.5-7b", nodes=1, allowed_pp=(2, 4), allowed_tp=(1,), bubble_ratio_threshold=0.001)
    job = plan(inp)
    assert not job.feasible
    smallest = min(p.value for p in job.pruned if p.code == "bubble_ratio" and p.value is not None)
    needed = round(smallest * 1.05 + 0.005, 2)
    assert f"global_resource_planner.train_pipeline_bubble_ratio_threshold: {needed} makes it plan" in \
        "\n".join(job.suggestions)
    assert search(replace(inp, space=replace(inp.space, bubble_ratio_threshold=needed))).feasible
