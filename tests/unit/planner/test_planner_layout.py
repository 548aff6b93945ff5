"""`planner.layout` is the one owner of parallel-size rules: `libra validate`, the planner's search and the
training pool's spec check give the same verdict, with the same factors, on every layout of a table."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest
from planner_cases import MODELS, dense, inputs, model

from libra.config import ConfigError, load_dict
from libra.config.mapping import cpu_config, training_pool_spec
from libra.training.spec import derive_layout
from planner.layout import TrainLayout
from planner.plan import Candidate
from planner.search import evaluate

NODES, GPUS_PER_NODE = 4, 8
# what all three layers check (the node size is the planner's and validation's only; CP > 1 is refused by
# validation until the training workers support it, so its context-length rule is the planner's alone)
SHARED_CODES = ("degree_positive", "tp_heads", "tp_kv_heads", "vpp_needs_pp", "pp_layers", "ep_dense", "ep_experts",
                "split_divisibility", "ep_data_parallel")

# id: (model directory, training GPUs, layout, planner codes expected, in order)
CASES: dict[str, tuple[str, int, TrainLayout, tuple[str, ...]]] = {
    "dense-tp2-valid": ("qwen2.5-7b", 8, TrainLayout(tp=2), ()),
    "tp8-breaks-heads-and-kv-heads": ("qwen2.5-7b", 8, TrainLayout(tp=8), ("tp_heads", "tp_kv_heads")),
    "pp8-breaks-28-layers": ("qwen2.5-7b", 8, TrainLayout(pp=8), ("pp_layers",)),
    "vpp-without-pp": ("qwen2.5-7b", 8, TrainLayout(vpp=2), ("vpp_needs_pp",)),
    "world-not-a-multiple": ("qwen2.5-7b", 6, TrainLayout(tp=4), ("split_divisibility",)),
    "pp-counts-in-model-parallel": ("qwen2.5-7b", 12, TrainLayout(tp=4, pp=2), ("split_divisibility",)),
    "ep-on-dense": ("qwen2.5-7b", 8, TrainLayout(ep=2), ("ep_dense",)),
    "moe-tp2-ep8-valid": ("qwen3-30b-a3b", 16, TrainLayout(tp=2, ep=8), ()),
    "ep3-breaks-experts-and-dp": ("qwen3-30b-a3b", 8, TrainLayout(ep=3), ("ep_experts", "ep_data_parallel")),
    "ep-outside-dp": ("qwen3-30b-a3b", 8, TrainLayout(tp=4, ep=4), ("ep_data_parallel",)),
    "pp2-vpp5-breaks-48-layers": ("qwen3-30b-a3b", 8, TrainLayout(pp=2, vpp=5), ("pp_layers",)),
}


def _planner_messages(name: str, world: int, layout: TrainLayout) -> tuple[tuple[str, ...], set[str]]:
    """Codes and messages of the planner's own evaluation of the candidate (the search's scalar path)."""
    inp = inputs(name, nodes=NODES, gpus_per_node=GPUS_PER_NODE)
    ev = evaluate(inp, Candidate(world, NODES * GPUS_PER_NODE - world, layout, 1), check_thresholds=False)
    shared = [v for v in ev.violations if v.code in SHARED_CODES]
    return tuple(v.code for v in shared), {v.message for v in shared}


def _validation_messages(name: str, world: int, layout: TrainLayout) -> set[str]:
    """Messages of every `layout.*` error `libra validate` reports for the same job."""
    data: dict[str, Any] = {
        "model_path": os.path.join(MODELS, name),
        "cluster": {"num_nodes": NODES, "gpus_per_node": GPUS_PER_NODE, "gpu_type": "H100"},
        "train_gpus": world, "rollout_gpus": NODES * GPUS_PER_NODE - world,
        "train_tp_size": layout.tp, "train_pp_size": layout.pp, "train_cp_size": layout.cp,
        "train_ep_size": layout.ep, "train_vpp_size": layout.vpp,
        "batch_size": 16, "n_samples": 8,
        "global_resource_planner": {"initial_allocation_strategy": "configured"},
    }
    try:
        load_dict(data)
    except ConfigError as err:
        return {part for issue in err.errors if issue.rule_id.startswith("layout.") for part in issue.rule.split("; ")}
    return set()


def _training_messages(name: str, world: int, layout: TrainLayout) -> set[str]:
    """Messages of the training pool's spec check (each error is `training.<field>=<value>: <message>`)."""
    spec = replace(training_pool_spec(cpu_config(os.path.join(MODELS, name)), num_gpus=world), **layout.as_dict())
    _, errors = derive_layout(spec, model(name))
    return {error.split(": ", 1)[1] for error in errors}


@pytest.mark.parametrize(("name", "world", "layout", "codes"), CASES.values(), ids=CASES.keys())
def test_validation_planner_and_training_agree(name: str, world: int, layout: TrainLayout,
                                               codes: tuple[str, ...]) -> None:
    planner_codes, planner_messages = _planner_messages(name, world, layout)
    assert planner_codes == codes
    assert _validation_messages(name, world, layout) == planner_messages
    assert _training_messages(name, world, layout) == planner_messages


def test_every_problem_is_returned_with_its_factors() -> None:
    """Several broken rules at once: all of them, each printing the numbers involved."""
    found = TrainLayout(tp=3, pp=5, ep=2).problems(dense(), world=20)  # 16 heads, 4 KV heads, 8 layers
    by_code = {p.code: p for p in found}
    assert list(by_code) == ["tp_heads", "tp_kv_heads", "pp_layers", "ep_dense", "split_divisibility"]
    assert by_code["split_divisibility"].message == (
        "TP x PP x CP = 3 x 5 x 1 = 15 does not divide the 20 training GPUs (DP = GPUs / (TP x PP x CP))")
    assert by_code["pp_layers"].message == "PP 5 x virtual stages 1 = 5 does not divide the 8 layers"
    assert [p.degree for p in found] == ["tp", "tp", "pp", "ep", "world"]


def test_ep_rule_prints_megatron_core_factors() -> None:
    (problem,) = TrainLayout(tp=2, ep=4, pp=2).problems(model("qwen3-30b-a3b"), world=8)
    assert problem.code == "ep_data_parallel"
    assert problem.message == ("EP 4 does not divide DP x CP = 2 x 1 = 2: Megatron-Core places EP x TP = 8 ranks "
                               "inside the GPUs of one pipeline stage (8 / PP 2 = 4)")


@pytest.mark.parametrize(("given", "codes"), [
    ({}, ["vpp_needs_pp"]),
    ({"gpus_per_node": 2}, ["tp_node", "vpp_needs_pp"]),
    ({"max_model_len": 4097}, ["vpp_needs_pp", "cp_sequence"]),
    ({"attention_backend": "eager"}, ["vpp_needs_pp", "cp_backend"]),
], ids=["no-facts", "node-size", "context-length", "attention-backend"])
def test_checks_run_for_the_facts_given(given: dict[str, Any], codes: list[str]) -> None:
    assert [p.code for p in TrainLayout(tp=4, cp=2, vpp=2).problems(**given)] == codes


def test_non_positive_degrees_stop_before_any_division() -> None:
    found = TrainLayout(tp=0, pp=2).problems(dense(), world=0)
    assert [(p.code, p.degree) for p in found] == [("degree_positive", "tp"), ("degree_positive", "world")]


def test_dims_derive_dp_from_the_pool_size() -> None:
    assert TrainLayout(tp=2, pp=2, ep=2).dims(16) == {"world": 16, "tp": 2, "pp": 2, "cp": 1, "ep": 2, "vpp": 1, "dp": 4}
