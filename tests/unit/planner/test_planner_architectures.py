"""`planner.architectures`: the one list of model types and what planning, training and rollout support, read
by validation, the planner and the training workers alike."""

from __future__ import annotations

import ast
import pathlib
from dataclasses import replace

import pytest
from planner_cases import dense, inputs, model

from libra.training import hf_arch
from planner.architectures import (
    ARCHITECTURES,
    PLAN,
    ROLLOUT,
    TRAIN,
    missing_capabilities,
    supporting,
    training_gaps,
    unsupported_message,
)
from planner.workload import PlannerInputError

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("model_type", "plan", "train", "rollout"), [
    ("llama", True, True, True),
    ("qwen2", True, True, True),
    ("qwen3", True, True, True),
    ("qwen3_moe", True, True, True),
    ("mistral", True, False, True),
    ("mixtral", True, False, True),
    ("qwen2_moe", True, False, True),
    ("gpt2", False, False, False),
], ids=lambda v: str(v))
def test_capabilities_of_each_model_type(model_type: str, plan: bool, train: bool, rollout: bool) -> None:
    expected = tuple(c for c, ok in ((PLAN, plan), (TRAIN, train), (ROLLOUT, rollout)) if not ok)
    assert missing_capabilities(model_type) == expected


def test_training_support_is_what_the_conversion_maps() -> None:
    """The trainable types are exactly those the HF <-> Megatron table of convert.py is written for."""
    doc = ast.get_docstring(ast.parse((ROOT / "libra" / "training" / "convert.py").read_text()))
    assert doc is not None and doc.startswith("HF <-> Megatron-Core weight mapping for Llama / Qwen2 / Qwen3 (dense and MoE)")
    assert supporting(TRAIN) == ("llama", "qwen2", "qwen3", "qwen3_moe")


def test_message_names_what_is_missing_and_who_has_it() -> None:
    assert unsupported_message("qwen3_moe") == ""
    assert unsupported_message("mixtral", (TRAIN,)) == (
        "model_type 'mixtral' (Mixtral MoE): training has no HF <-> Megatron-Core weight conversion for it "
        "(supported: llama, qwen2, qwen3, qwen3_moe); the block_sparse_moe experts (w1/w2/w3) are not mapped to "
        "Megatron-Core")
    unknown = unsupported_message("gpt2")
    assert unknown.startswith("model_type 'gpt2': the planner has no memory and cost model for it (supported: ")
    assert "the rollout pool (vLLM) cannot serve it" in unknown


@pytest.mark.parametrize("name", ["qwen2.5-7b", "qwen2.5-32b", "qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_repository_models_are_trainable(name: str) -> None:
    assert training_gaps(model(name)) == []


GAPS = {
    "gelu": (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    "mlp-bias": (dict(mlp_bias=True), "mlp_bias=true"),
    "o-proj-bias": (dict(output_bias=True), "attention_bias=true (o_proj bias)"),
    "sliding-window": (dict(sliding_window=True), "use_sliding_window=true"),
    "rope-scaling": (dict(rope_type="yarn"), "rope type 'yarn'"),
    "uneven-gqa": (dict(num_kv_heads=3), "not a multiple of num_key_value_heads=3"),
    "no-max-positions": (dict(max_position_embeddings=0), "max_position_embeddings is missing"),
    "mixtral-type": (dict(model_type="mixtral"), "model_type 'mixtral'"),
}


@pytest.mark.parametrize(("changes", "message"), GAPS.values(), ids=GAPS.keys())
def test_training_gaps_name_the_field(changes: dict, message: str) -> None:
    spec = replace(dense(max_position_embeddings=4096), **changes)
    gaps = training_gaps(spec)
    assert len(gaps) == 1 and message in gaps[0]
    with pytest.raises(hf_arch.UnsupportedArchitectureError, match="config.json: "):
        hf_arch.trainable(spec, "config.json")


def test_planner_refuses_a_model_type_it_has_no_model_for() -> None:
    bad = inputs(replace(model("qwen2.5-7b"), model_type="gpt2"))
    with pytest.raises(PlannerInputError, match="model_type 'gpt2': the planner has no memory and cost model"):
        bad.validate()


# The tiny development model is built from these families only (a `Literal` of the config schema and the
# builder's list): a choice of what to build, which must stay inside what Libra can train and serve.
TINY_MODEL_FAMILIES = {"libra/config/sections.py", "libra/models/tiny.py"}


def test_tiny_model_families_are_trainable_and_servable() -> None:
    from libra.models.tiny import ARCHS

    assert set(ARCHS) <= set(supporting(TRAIN)) & set(supporting(ROLLOUT))


def test_no_other_list_of_model_types() -> None:
    """Validation, planner and training read the table; no module keeps a tuple of model types of its own."""
    offenders = []
    for path in [*(ROOT / "libra").rglob("*.py"), *(ROOT / "planner").rglob("*.py")]:
        if path.name == "architectures.py" or str(path.relative_to(ROOT)) in TINY_MODEL_FAMILIES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set) and sum(
                    isinstance(e, ast.Constant) and e.value in ARCHITECTURES for e in node.elts) >= 2:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
