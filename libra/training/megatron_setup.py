"""Megatron-Core objects of a training worker: parallel state, `TransformerConfig`, `GPTModel` chunks with the
local (non-TransformerEngine) layer spec, the DDP wrapper, the optimizer and its LR scheduler.

The `*_kwargs` functions are pure: they map a `ModelSpec` + `TrainingPoolSpec` to the keyword arguments of the
Megatron config classes, so it is testable without a process group that each `megatron_*` option arrives at
the field it names (see `MEGATRON_OPTION_FIELDS`).
"""

from __future__ import annotations

from typing import Any

import torch

from libra.training.hf_arch import padded_vocab_size
from libra.training.spec import OptimizerSpec, TrainingPoolSpec
from planner.layout import TrainLayout
from planner.model_spec import ModelSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# spec.megatron field -> (Megatron config class, field name)
MEGATRON_OPTION_FIELDS = {
    "use_precision_aware_optimizer": ("OptimizerConfig", "use_precision_aware_optimizer"),
    "optimizer_cpu_offload": ("OptimizerConfig", "optimizer_cpu_offload"),
    "optimizer_offload_fraction": ("OptimizerConfig", "optimizer_offload_fraction"),
    "use_distributed_optimizer": ("OptimizerConfig", "use_distributed_optimizer"),
    "use_cpu_initialization": ("TransformerConfig", "use_cpu_initialization"),
    "grouped_gemm": ("TransformerConfig", "moe_grouped_gemm"),
    "recompute_granularity": ("TransformerConfig", "recompute_granularity"),
}


def recompute_kwargs(granularity: str) -> dict[str, Any]:
    """`TransformerConfig` activation-recomputation fields for `megatron_recompute_granularity`.

    selective: Megatron-Core recomputes the core attention (its default `recompute_modules`) and needs
    no method. full: every transformer layer is a recompute unit (`uniform`, 1 layer), so only each
    layer's input is kept and one layer's activations are rebuilt during backward, which is what the
    planner's memory model budgets. none: Megatron-Core's `None`."""
    if granularity == "none":
        return dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    if granularity == "selective":
        return dict(recompute_granularity="selective", recompute_method=None, recompute_num_layers=None)
    if granularity == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    raise ValueError(f"megatron recompute_granularity={granularity!r} is not one of none, selective, full")


def uses_sequence_parallel(arch: ModelSpec, layout: TrainLayout) -> bool:
    """Megatron requires sequence parallelism for MoE with TP > 1 (else off: it needs seq_len % TP == 0)."""
    return arch.is_moe and layout.tp > 1


def transformer_config_kwargs(arch: ModelSpec, spec: TrainingPoolSpec, layout: TrainLayout, cuda: bool) -> dict[str, Any]:
    """Keyword arguments of `TransformerConfig` for `arch` under `layout`.

    Dropout is off (RL fine-tuning, and it keeps log-probs deterministic); fusions that need CUDA kernels
    are off. `calculate_per_token_loss` makes Megatron sum the loss over micro batches and data-parallel
    ranks and divide once by the total unit count our loss function reports.
    On a CPU machine weights are always initialized on the CPU (`use_cpu_initialization` forced on).
    """
    dtype = DTYPES[spec.params_dtype]
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size or arch.moe_intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.attention_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        sequence_parallel=uses_sequence_parallel(arch, layout),
        # Batched p2p posts the activation and the gradient to the same peer in one batch; with PP=2 and
        # VPP the previous and the next stage are the same rank and the two tensors (same shape) can be
        # matched to the wrong receives. The per-direction path keeps them apart (Megatron-LM also turns
        # batching off with VPP, where it overlaps p2p communication instead).
        batch_p2p_comm=layout.vpp == 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=spec.params_dtype == "bf16",
        fp16=spec.params_dtype == "fp16",
        use_cpu_initialization=spec.megatron.use_cpu_initialization or not cuda,
        moe_grouped_gemm=spec.megatron.grouped_gemm,
        calculate_per_token_loss=True,
        init_method_std=0.02,
        **recompute_kwargs(spec.megatron.recompute_granularity),
    )
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            moe_router_topk=arch.num_experts_per_tok,
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            # the all-to-all dispatcher creates CUDA streams; the all-gather one runs on gloo
            moe_token_dispatcher_type="alltoall" if cuda else "allgather",
        )
    return kwargs


def optimizer_config_kwargs(spec: TrainingPoolSpec) -> dict[str, Any]:
    """Keyword arguments of Megatron's `OptimizerConfig` (Adam)."""
    opt, meg = spec.optimizer, spec.megatron
    dtype = DTYPES[spec.params_dtype]
    return dict(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        params_dtype=dtype,
        bf16=spec.params_dtype == "bf16",
        fp16=spec.params_dtype == "fp16",
        use_distributed_optimizer=meg.use_distributed_optimizer,
        use_precision_aware_optimizer=meg.use_precision_aware_optimizer,
        optimizer_cpu_offload=meg.optimizer_cpu_offload,
        optimizer_offload_fraction=meg.optimizer_offload_fraction,
    )


def ddp_config_kwargs(spec: TrainingPoolSpec) -> dict[str, Any]:
    """Keyword arguments of `DistributedDataParallelConfig`."""
    return dict(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=spec.megatron.use_distributed_optimizer,
    )


def initialize_parallel_state(layout: TrainLayout) -> None:
    """Create Megatron's TP/PP/CP/EP/DP groups on the already initialized default process group."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
    )


def build_transformer_config(arch: ModelSpec, spec: TrainingPoolSpec, layout: TrainLayout, cuda: bool):  # type: ignore[no-untyped-def]
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**transformer_config_kwargs(arch, spec, layout, cuda))


def build_model_chunks(arch: ModelSpec, config, layout: TrainLayout) -> list[torch.nn.Module]:  # type: ignore[no-untyped-def]
    """The `GPTModel` chunk(s) of this rank's pipeline stage (VPP chunks in order)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer_spec = get_gpt_layer_local_spec(
        num_experts=arch.num_experts or None,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=arch.qk_norm,
        normalization="RMSNorm",
    )
    vocab = padded_vocab_size(arch.vocab_size, layout.tp)
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(layout.vpp):
        stage = vp_stage if layout.vpp > 1 else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=vocab,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=int(arch.rope_theta),
            vp_stage=stage,
        )
        chunks.append(model)
    return chunks


def wrap_ddp(chunks: list[torch.nn.Module], config, spec: TrainingPoolSpec) -> list[torch.nn.Module]:  # type: ignore[no-untyped-def]
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(**ddp_config_kwargs(spec))
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]


def build_optimizer(ddp_chunks: list[torch.nn.Module], spec: TrainingPoolSpec):  # type: ignore[no-untyped-def]
    """Megatron optimizer + LR scheduler: linear warm-up to `lr`, then constant or a linear / cosine decay to
    `min_lr` at `lr_decay_steps` (the scheduler is stepped once per training step)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(**optimizer_config_kwargs(spec))
    optimizer = get_megatron_optimizer(opt_config, ddp_chunks)
    return optimizer, OptimizerParamScheduler(optimizer, **scheduler_kwargs(spec.optimizer))


def scheduler_kwargs(o: OptimizerSpec) -> dict[str, Any]:
    """Megatron `OptimizerParamScheduler` arguments for the schedule `o` describes."""
    return dict(
        init_lr=0.0 if o.lr_warmup_steps else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_steps,
        lr_decay_steps=max(o.lr_decay_steps, o.lr_warmup_steps + 1),
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=0,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )
