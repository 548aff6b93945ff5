"""The megatron_* options arrive at the Megatron config fields they name, in real Megatron config objects."""

from __future__ import annotations

from dataclasses import replace

import pytest

from libra.config.mapping import config_with, training_pool_spec
from libra.training import megatron_setup
from libra.training.spec import TrainingPoolSpec, derive_layout
from planner.model_spec import ModelSpec

ARCH = ModelSpec(
    name="moe", model_type="qwen3_moe", vocab_size=219, hidden_size=64, num_layers=2, num_attention_heads=4,
    num_kv_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
    rope_theta=1e4, qk_norm=True, num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2,
)
SPEC = training_pool_spec(config_with("/m", train_ep_size=2, megatron_params_dtype="fp32"), num_gpus=2)
OPTIONS = {
    "precision-aware": ("use_precision_aware_optimizer", True),
    "cpu-offload": ("optimizer_cpu_offload", True),
    "offload-fraction": ("optimizer_offload_fraction", 0.25),
    "distributed-optimizer": ("use_distributed_optimizer", True),
    "cpu-initialization": ("use_cpu_initialization", True),
    "grouped-gemm": ("grouped_gemm", True),
    "recompute-selective": ("recompute_granularity", "selective"),
    "recompute-full": ("recompute_granularity", "full"),
}


def _kwargs(spec: TrainingPoolSpec, cuda: bool = True) -> dict[str, dict]:
    layout, _ = derive_layout(spec, ARCH)
    assert layout is not None
    return {
        "OptimizerConfig": megatron_setup.optimizer_config_kwargs(spec),
        "TransformerConfig": megatron_setup.transformer_config_kwargs(ARCH, spec, layout, cuda=cuda),
    }


@pytest.mark.parametrize("option,value", OPTIONS.values(), ids=OPTIONS.keys())
def test_option_reaches_its_megatron_field(option: str, value: object) -> None:
    config_cls, field = megatron_setup.MEGATRON_OPTION_FIELDS[option]
    default = _kwargs(SPEC)[config_cls][field]
    assert default != value
    spec = replace(SPEC, megatron=replace(SPEC.megatron, **{option: value}))  # type: ignore[arg-type]
    assert _kwargs(spec)[config_cls][field] == value


def test_options_build_real_megatron_configs() -> None:
    """The kwargs construct Megatron's own config classes, which keep the values. (The precision-aware
    optimizer is left out here: OptimizerConfig refuses it without TransformerEngine installed.)"""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    meg = replace(SPEC.megatron, use_distributed_optimizer=True, optimizer_cpu_offload=True,
                  optimizer_offload_fraction=0.5, use_cpu_initialization=True)
    spec = replace(SPEC, megatron=meg, optimizer=replace(SPEC.optimizer, lr=3e-6, clip_grad=0.5))
    kw = _kwargs(spec)
    opt = OptimizerConfig(**kw["OptimizerConfig"])
    assert (opt.use_distributed_optimizer, opt.optimizer_cpu_offload) == (True, True)
    assert (opt.optimizer_offload_fraction, opt.lr, opt.clip_grad) == (0.5, 3e-6, 0.5)
    tc = TransformerConfig(**kw["TransformerConfig"])
    assert tc.use_cpu_initialization and tc.num_moe_experts == 4 and tc.moe_router_topk == 2
    assert tc.expert_model_parallel_size == 2 and tc.calculate_per_token_loss
    assert tc.qk_layernorm and tc.num_query_groups == 2 and tc.kv_channels == 16


def test_cpu_forces_cpu_initialization_and_allgather_dispatch() -> None:
    kw = _kwargs(SPEC, cuda=False)["TransformerConfig"]
    assert kw["use_cpu_initialization"] is True
    assert kw["moe_token_dispatcher_type"] == "allgather"
    assert _kwargs(SPEC, cuda=True)["TransformerConfig"]["moe_token_dispatcher_type"] == "alltoall"


RECOMPUTE = {
    "none": (None, None, None),
    "selective": ("selective", None, None),
    "full": ("full", "uniform", 1),
}


@pytest.mark.parametrize("granularity,expected", RECOMPUTE.items(), ids=RECOMPUTE.keys())
def test_recompute_granularity_builds_megatron_recomputation(granularity: str, expected: tuple) -> None:
    """megatron_recompute_granularity reaches Megatron-Core's TransformerConfig as it expects it: full
    recomputes every layer (uniform, one layer per unit), selective the core attention."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec = training_pool_spec(config_with("/m", train_ep_size=2, megatron_params_dtype="fp32",
                                          megatron_recompute_granularity=granularity), num_gpus=2)
    tc = TransformerConfig(**_kwargs(spec)["TransformerConfig"])
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == expected
    if granularity == "selective":
        assert tc.recompute_modules == ["core_attn"]
