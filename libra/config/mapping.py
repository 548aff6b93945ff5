"""The one explicit mapping from a job `Config` to the objects that act on it.

Each function below builds one runtime spec or planner input and names every field it fills: the training
pool (`TrainingPoolSpec` with `AlgorithmSpec`, `OptimizerSpec`, `MegatronOptions`, `CheckpointRetention`),
the rollout pool (`RolloutPoolSpec`), the CPU slices of both (`CpuMetering`), the tiny development model
(`TinyModelSpec`) and the planner's `Workload`, `TrainOptions`, `RolloutOptions` and `MemoryBudget`. The runtime specs have no defaults of their
own for what a user can set, so an option cannot be dropped on the way without a type error; which option
reaches which field is declared in `libra.config.consumers` and tested field by field.

`config_with(model_path, **changes)` is a `Config` with every option at its default except the given ones,
for scripts and tests that build one pool directly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

from libra.algo.spec import AlgorithmSpec, ISCorrectionSpec, RefKLSpec
from libra.config.schema import AlgorithmConfig, CheckpointConfig, Config, OptimizerConfig, TinyModelConfig
from libra.metering.spec import CpuMetering
from libra.models.tiny import TinyModelSpec
from libra.observability.phase_trace import TraceSettings
from libra.rollout.spec import NODE_IP, HealthRule, RolloutPoolSpec
from libra.training.call_deadlines import HangRule
from libra.training.spec import CheckpointRetention, MegatronOptions, OptimizerSpec, TrainingPoolSpec
from planner.layout import TrainLayout
from planner.workload import MemoryBudget, RolloutOptions, TrainOptions, Workload

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


# ------------------------------------------------------------------------------------------ training pool
def algorithm_spec(a: AlgorithmConfig) -> AlgorithmSpec:
    """`algorithm.*` -> the loss settings of the training workers."""
    return AlgorithmSpec(
        advantage_norm_mode=a.advantage_norm_mode,
        loss_agg_mode=a.loss_agg_mode,
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        entropy_coef=a.entropy_coef,
        ref_kl=RefKLSpec(enable=a.ref_kl.enable, coef=a.ref_kl.coef, kl_type=a.ref_kl.kl_type),
        is_correction=ISCorrectionSpec(
            enable=a.is_correction.enable,
            action=a.is_correction.action,
            level=a.is_correction.level,
            lower_bound=a.is_correction.lower_bound,
            upper_bound=a.is_correction.upper_bound,
        ),
    )


def optimizer_spec(o: OptimizerConfig, total_steps: int) -> OptimizerSpec:
    """`optimizer.*` -> Megatron's Adam and the learning-rate schedule, which decays over the job's
    `total_steps`."""
    return OptimizerSpec(
        lr=o.lr,
        min_lr=o.min_lr,
        lr_decay_style=o.lr_decay_style,
        lr_decay_steps=total_steps,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        lr_warmup_steps=o.lr_warmup_steps,
    )


def megatron_options(cfg: Config) -> MegatronOptions:
    """`megatron_*` -> the Megatron-Core switches of the training workers."""
    return MegatronOptions(
        use_precision_aware_optimizer=cfg.megatron_use_precision_aware_optimizer,
        optimizer_cpu_offload=cfg.megatron_optimizer_cpu_offload,
        optimizer_offload_fraction=cfg.megatron_optimizer_offload_fraction,
        use_cpu_initialization=cfg.megatron_use_cpu_initialization,
        grouped_gemm=cfg.megatron_grouped_gemm,
        use_distributed_optimizer=cfg.megatron_use_distributed_optimizer,
        recompute_granularity=cfg.megatron_recompute_granularity,
    )


def checkpoint_retention(c: CheckpointConfig) -> CheckpointRetention:
    """`checkpoint.keep_last` / `keep_every` -> which checkpoints the workers keep (0 = keep all -> the
    newest one at least)."""
    return CheckpointRetention(keep_last=max(1, c.keep_last), keep_every=c.keep_every)


def configured_layout(cfg: Config) -> TrainLayout:
    """The pinned training layout (`train_*_size`)."""
    return TrainLayout(tp=cfg.train_tp_size, pp=cfg.train_pp_size, cp=cfg.train_cp_size, ep=cfg.train_ep_size,
                       vpp=cfg.train_vpp_size)


def training_pool_spec(cfg: Config, num_gpus: int, layout: TrainLayout | None = None, run_dir: str = "",
                       trace: TraceSettings | None = None) -> TrainingPoolSpec:
    """The training pool of `num_gpus` workers under `layout` (the plan's; default: the pinned one)."""
    layout = layout or configured_layout(cfg)
    return TrainingPoolSpec(
        model_path=cfg.model_dir(),
        num_gpus=num_gpus,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        ep=layout.ep,
        vpp=layout.vpp,
        micro_batch_size=cfg.train_micro_batch_size,
        recompute_logprobs=cfg.recompute_logprobs,
        recompute_micro_batch_size=cfg.recompute_micro_batch_size,
        algorithm=algorithm_spec(cfg.algorithm),
        optimizer=optimizer_spec(cfg.optimizer, cfg.total_steps),
        megatron=megatron_options(cfg),
        seed=cfg.seed,
        run_dir=run_dir,
        params_dtype=cfg.megatron_params_dtype,
        retention=checkpoint_retention(cfg.checkpoint),
        metering=cpu_metering(cfg),
        hang=HangRule(timeout_s=cfg.train_hang_timeout_s, factor=cfg.train_hang_timeout_factor),
        trace=trace,
    )


# ------------------------------------------------------------------------------------------- rollout pool
def rollout_pool_spec(cfg: Config, num_instances: int, kv_cache_bytes: int, run_dir: str = "",
                      trace: TraceSettings | None = None) -> RolloutPoolSpec:
    """The rollout pool of `num_instances` vLLM servers; `kv_cache_bytes` is `rollout_kv_cache_bytes` after
    the device default is applied (the caller knows the device)."""
    gpr = cfg.global_resource_planner
    return RolloutPoolSpec(
        model_path=cfg.model_dir(),
        num_instances=num_instances,
        tp_size=cfg.rollout_tp_size,
        max_model_len=cfg.max_model_len,
        kv_cache_bytes=kv_cache_bytes,
        port_base=cfg.rollout_port_base,
        enforce_eager=cfg.rollout_enforce_eager,
        manage_processes=gpr.runtime_manage_rollout_processes,
        endpoints=tuple(cfg.rollout_endpoints),
        reload_method=cfg.rollout_weight_reload_method,
        reload_strategy=cfg.rollout_weight_reload_strategy,
        max_concurrent_requests=cfg.effective_max_concurrent_rollouts,
        run_dir=run_dir,
        seed=cfg.seed,
        gpu_memory_utilization=cfg.rollout_gpu_memory_utilization,
        metering=cpu_metering(cfg),
        trace=trace,
        health=health_rule(cfg),
        # servers on other nodes must answer the controller on their node's address, not on loopback
        bind_host=NODE_IP if cfg.cluster.num_nodes > 1 else "127.0.0.1",
    )


def health_rule(cfg: Config) -> HealthRule:
    """`rollout_health_check_*`, `rollout_stall_timeout_s` -> the rule by which the rollout pool declares a server
    failed."""
    return HealthRule(interval_s=cfg.rollout_health_check_interval_s, timeout_s=cfg.rollout_health_check_timeout_s,
                      failures_to_fail=cfg.rollout_health_check_failures, stall_s=cfg.rollout_stall_timeout_s)


# ------------------------------------------------------------------------------------------ CPU metering
def cpu_metering(cfg: Config) -> CpuMetering:
    """`cluster.metered_cpu_per_gpu` / `metered_cgroup_root` -> the CPU slices of both pools' GPU holders,
    named after the job and its run directory (two runs of one job name never touch each other's slices)."""
    run = hashlib.sha1(os.path.abspath(cfg.run_dir or os.path.join("runs", cfg.name)).encode()).hexdigest()[:8]
    return CpuMetering(cores_per_gpu=cfg.cluster.metered_cpu_per_gpu, job=f"{cfg.name}-{run}",
                       cgroup_root=cfg.cluster.metered_cgroup_root)


# ------------------------------------------------------------------------------------------ tiny model
def tiny_model_spec(t: TinyModelConfig) -> TinyModelSpec:
    """`build_tiny_model.*` -> the shape of the model the launcher builds."""
    return TinyModelSpec(
        arch=t.arch,
        hidden_size=t.hidden_size,
        num_layers=t.num_layers,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        intermediate_size=t.intermediate_size,
        max_position_embeddings=t.max_position_embeddings,
        init_std=t.init_std,
        seed=t.seed,
        vocab_size=t.vocab_size,
    )


# ------------------------------------------------------------------------------------------------ planner
def planner_workload(cfg: Config) -> Workload:
    """The RL step the planner sizes the pools for."""
    return Workload(
        batch_size=cfg.batch_size,
        n_samples=cfg.n_samples,
        max_model_len=cfg.max_model_len,
        max_new_tokens=cfg.max_new_tokens,
        expected_response_tokens=cfg.expected_response_tokens,
        max_concurrent_rollouts=cfg.max_concurrent_rollouts,
        max_head_offpolicyness=cfg.max_head_offpolicyness,
        recompute_logprobs=cfg.recompute_logprobs,
        recompute_micro_batch_size=cfg.recompute_micro_batch_size,
        train_micro_batch_size=cfg.train_micro_batch_size,
        sync_interval=cfg.sync_interval,
    )


def planner_train_options(cfg: Config, moe: bool, cpu: bool) -> TrainOptions:
    """The Megatron-Core options that change training memory or speed, as the workers run them: only MoE
    models use sequence parallelism (Megatron-Core requires it for them when TP > 1; see
    `libra.training.megatron_setup.uses_sequence_parallel`); Megatron-Core's local (non-TE) layers on a
    CPU use the unfused attention, GPUs flash attention."""
    return TrainOptions(
        params_dtype_bytes=DTYPE_BYTES[cfg.megatron_params_dtype],
        use_distributed_optimizer=cfg.megatron_use_distributed_optimizer,
        precision_aware_optimizer=cfg.megatron_use_precision_aware_optimizer,
        optimizer_cpu_offload=cfg.megatron_optimizer_cpu_offload,
        optimizer_offload_fraction=cfg.megatron_optimizer_offload_fraction,
        recompute_granularity=cfg.megatron_recompute_granularity,
        sequence_parallel=moe,
        vpp=cfg.train_vpp_size,
        implementation="megatron",
        attention_backend="eager" if cpu else "flash",
        fused_optimizer=not cpu,
    )


def planner_rollout_options(cfg: Config) -> RolloutOptions:
    return RolloutOptions(gpu_memory_utilization=cfg.rollout_gpu_memory_utilization,
                          kv_cache_bytes=cfg.rollout_kv_cache_bytes,
                          reload_method=cfg.rollout_weight_reload_method)


def planner_memory_budget(cfg: Config) -> MemoryBudget:
    """`global_resource_planner.memory_budget_*` (the dry run itself is the controller's)."""
    grp = cfg.global_resource_planner
    return MemoryBudget(
        check_enabled=grp.memory_budget_check_enabled,
        safety_margin_bytes=grp.memory_budget_safety_margin_bytes,
        logits_dtype_bytes=grp.memory_budget_logits_dtype_bytes,
        workspace_factor=grp.memory_budget_workspace_factor,
    )


# ---------------------------------------------------------------------------------- scripts and tests
def config_with(model_path: str, **changes: Any) -> Config:
    """A `Config` with every option at its default except `changes`; a section is changed with a dict of
    its fields (`optimizer={"lr": 1e-3}`). Not validated: for code that builds a pool spec directly."""
    cfg = Config(model_path=model_path)
    values: dict[str, Any] = {}
    for name, value in changes.items():
        current = getattr(cfg, name)
        if isinstance(value, dict) and dataclasses.is_dataclass(current):
            value = _replace_nested(current, value)
        values[name] = value
    return dataclasses.replace(cfg, **values)


def _replace_nested(section: Any, changes: dict[str, Any]) -> Any:
    values = {}
    for name, value in changes.items():
        current = getattr(section, name)
        values[name] = _replace_nested(current, value) if isinstance(value, dict) and \
            dataclasses.is_dataclass(current) else value
    return dataclasses.replace(section, **values)


# The CPU development settings a directly built training spec needs (fp32 parameters and no gradient
# clipping: megatron-core 0.16.1 runs mixed precision and clipping on CUDA only).
CPU_TRAINING = {"megatron_params_dtype": "fp32", "megatron_use_cpu_initialization": True,
                "optimizer": {"clip_grad": 0.0}}


def cpu_config(model_path: str, **changes: Any) -> Config:
    """`config_with` on top of the CPU development settings (`CPU_TRAINING`)."""
    merged: dict[str, Any] = dict(CPU_TRAINING)
    for name, value in changes.items():
        if isinstance(value, dict) and isinstance(merged.get(name), dict):
            value = {**merged[name], **value}
        merged[name] = value
    return config_with(model_path, **merged)
