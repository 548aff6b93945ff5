"""A corpus of bad configurations, one mistake each: every case must give exactly one error, on the
expected option, of the expected class and rule, with a fix. Plus one case per warning rule."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
from config_bases import DELETE, base_for, make_files, with_changes

from libra.config import RULES, ConfigError, load_dict, loader
from libra.config.checks_runtime import UNWIRED
from libra.config.errors import INVALID, NOT_IMPLEMENTED, NOT_VALIDATED, WARNING
from libra.config.rules import run_rules

GRP = "global_resource_planner"
IC, NI, NV = INVALID, NOT_IMPLEMENTED, NOT_VALIDATED
# elastic hybrid parallelism on: replicas of one TP2 copy (the bases' layouts) in a synchronous job
EHP_ON = {f"{GRP}.runtime_dynamic_reconfiguration_enabled": True, f"{GRP}.runtime_reconfigure_training": True,
          f"{GRP}.elastic_hybrid_replica_size_gpus": 2, "max_head_offpolicyness": 0}

# (id, base, changes, expected path, expected class, expected rule id)
BAD: list[tuple[str, str, dict[str, Any], str, str, str]] = [
    # single options: types, choices, bounds, unknown and missing keys
    ("str-for-int", "dense", {"train_gpus": "8"}, "train_gpus", IC, "type"),
    ("bool-for-int", "dense", {"batch_size": True}, "batch_size", IC, "type"),
    ("list-for-scalar", "dense", {"n_samples": [8]}, "n_samples", IC, "type"),
    ("str-for-bool", "dense", {"recompute_logprobs": "yes"}, "recompute_logprobs", IC, "type"),
    ("float-for-int", "dense", {"train_tp_size": 2.0}, "train_tp_size", IC, "type"),
    ("scalar-for-section", "dense", {"algorithm": 5}, "algorithm", IC, "type"),
    ("scalar-for-list", "dense", {f"{GRP}.allowed_train_tp": 2}, f"{GRP}.allowed_train_tp", IC, "type"),
    ("bool-in-params", "dense", {"task.params": {"modulus": True}}, "task.params.modulus", IC, "type"),
    ("bad-enum", "dense", {"algorithm.advantage_norm_mode": "group"}, "algorithm.advantage_norm_mode", IC, "choice"),
    ("bad-list-enum", "dense", {"tracking.backends": ["wandb"]}, "tracking.backends[0]", IC, "choice"),
    ("logits-dtype-bytes", "dense", {f"{GRP}.memory_budget_logits_dtype_bytes": 8},
     f"{GRP}.memory_budget_logits_dtype_bytes", IC, "choice"),
    ("negative-gpus", "dense", {"train_gpus": -1}, "train_gpus", IC, "range"),
    ("zero-tp", "dense", {"train_tp_size": 0}, "train_tp_size", IC, "range"),
    ("clip-low-range", "dense", {"algorithm.clip_ratio_low": 1.5}, "algorithm.clip_ratio_low", IC, "range"),
    ("clip-c-not-above-1", "dense", {"algorithm.clip_ratio_c": 1.0}, "algorithm.clip_ratio_c", IC, "range"),
    ("is-lower-not-below-1", "dense", {"algorithm.is_correction.lower_bound": 1.0},
     "algorithm.is_correction.lower_bound", IC, "range"),
    ("is-upper-not-above-1", "dense", {"algorithm.is_correction.upper_bound": 0.9},
     "algorithm.is_correction.upper_bound", IC, "range"),
    ("offload-fraction-range", "dense", {"megatron_optimizer_offload_fraction": 1.5},
     "megatron_optimizer_offload_fraction", IC, "range"),
    ("workspace-factor", "dense", {f"{GRP}.memory_budget_workspace_factor": 0.5},
     f"{GRP}.memory_budget_workspace_factor", IC, "range"),
    ("negative-margin", "dense", {f"{GRP}.memory_budget_safety_margin_bytes": -1},
     f"{GRP}.memory_budget_safety_margin_bytes", IC, "range"),
    ("allowed-item-zero", "dense", {f"{GRP}.allowed_train_tp": [0]}, f"{GRP}.allowed_train_tp[0]", IC, "range"),
    ("nan-float", "dense", {"optimizer.lr": float("nan")}, "optimizer.lr", IC, "range"),
    ("unknown-top", "dense", {"train_tp_sise": 2}, "train_tp_sise", IC, "unknown_key"),
    ("unknown-in-section", "dense", {"cluster.gpu_typ": "H100"}, "cluster.gpu_typ", IC, "unknown_key"),
    ("missing-model-path", "dense", {"model_path": DELETE}, "model_path", IC, "required"),
    # model and cluster
    ("model-missing", "dense", {"model_path": "/nonexistent/model"}, "model_path", IC, "model.config"),
    ("model-unsupported", "dense", {"model_path": "{tmp}/gpt2"}, "model_path", NI, "model.architecture"),
    ("model-not-trainable", "dense", {"model_path": "{tmp}/mixtral"}, "model_path", NI, "model.runnable"),
    ("tiny-disabled-no-model", "cpu", {"build_tiny_model.enabled": False}, "model_path", IC, "model.config"),
    ("gpu-type-unknown", "dense", {"cluster.gpu_type": "H999"}, "cluster.gpu_type", IC, "cluster.gpu_type"),
    ("gpu-spec-incomplete", "dense", {"cluster.gpu_type": "custom", "cluster.gpu_spec": {
        "memory_gb": 64, "bf16_dense_tflops": 400, "hbm_tb_per_s": 2.0, "intra_node_gb_per_s": 100}},
     "cluster.gpu_spec.inter_node_gb_per_s", IC, "cluster.gpu_type"),
    ("gpus-per-node", "dense", {"cluster.gpus_per_node": 16, "cluster.num_nodes": 1}, "cluster.gpus_per_node", IC,
     "cluster.gpus_per_node"),
    ("logical-needs-cpu-type", "cpu", {"cluster.gpu_type": "H100"}, "cluster.gpu_type", IC, "cluster.logical_gpus"),
    ("cpu-type-needs-logical", "cpu", {"cluster.logical_gpus": False}, "cluster.logical_gpus", IC,
     "cluster.logical_gpus"),
    # split
    ("split-exceeds-cluster", "dense", {"rollout_gpus": 16}, "train_gpus", IC, "split.fits_cluster"),
    ("pinned-needs-train-gpus", "dense", {"train_gpus": 0}, "train_gpus", IC, "split.pinned"),
    ("min-gpus-exceed", "dense", {f"{GRP}.initial_allocation_strategy": "grp", f"{GRP}.min_train_gpus": 10,
                                f"{GRP}.min_rollout_gpus": 8}, f"{GRP}.min_train_gpus", IC, "planner.min_gpus_fit"),
    ("min-train-above-split", "dense", {f"{GRP}.min_train_gpus": 12}, f"{GRP}.min_train_gpus", IC,
     "planner.min_within_split"),
    ("granularity-cluster", "dense", {f"{GRP}.allocation_granularity_gpus": 3}, f"{GRP}.allocation_granularity_gpus",
     IC, "planner.granularity"),
    ("granularity-split", "dense", {"train_gpus": 4, "rollout_gpus": 12, f"{GRP}.allocation_granularity_gpus": 8},
     f"{GRP}.allocation_granularity_gpus", IC, "planner.granularity"),
    ("min-rollout-instances", "dense", {"rollout_tp_size": 2, f"{GRP}.min_rollout_gpus": 3},
     f"{GRP}.min_rollout_gpus", IC, "planner.min_rollout_instances"),
    ("safety-margin-too-big", "dense", {f"{GRP}.memory_budget_safety_margin_bytes": 80 * 10**9},
     f"{GRP}.memory_budget_safety_margin_bytes", IC, "planner.safety_margin"),
    # training layout
    ("layout-divides", "dense", {"train_gpus": 6, "train_tp_size": 4}, "train_tp_size", IC, "layout.divides_train_gpus"),
    ("tp-heads", "dense", {"train_tp_size": 8}, "train_tp_size", IC, "layout.tp_heads"),
    ("pp-layers", "dense", {"train_gpus": 6, "train_pp_size": 3}, "train_pp_size", IC, "layout.pp_layers"),
    ("vpp-needs-pp", "dense", {"train_vpp_size": 2}, "train_vpp_size", IC, "layout.vpp_needs_pp"),
    ("ep-on-dense", "dense", {"train_ep_size": 2}, "train_ep_size", IC, "layout.ep_moe"),
    ("ep-experts", "moe", {"train_gpus": 12, "rollout_gpus": 4, "train_tp_size": 1, "train_ep_size": 3},
     "train_ep_size", IC, "layout.ep_moe"),
    ("ep-layout", "moe", {"train_ep_size": 8}, "train_ep_size", IC, "layout.ep_divides_train_gpus"),
    ("allowed-tp-none", "dense", {f"{GRP}.allowed_train_tp": [8, 16]}, f"{GRP}.allowed_train_tp", IC,
     "planner.allowed_usable"),
    ("allowed-ep-dense-none", "dense", {f"{GRP}.allowed_train_ep": [2, 4]}, f"{GRP}.allowed_train_ep", IC,
     "planner.allowed_usable"),
    ("allowed-pp-none", "dense", {f"{GRP}.allowed_train_pp": [3, 5]}, f"{GRP}.allowed_train_pp", IC,
     "planner.allowed_usable"),
    ("allowed-duplicate", "dense", {f"{GRP}.allowed_train_cp": [1, 1]}, f"{GRP}.allowed_train_cp", IC,
     "planner.allowed_unique"),
    # rollout
    ("rollout-tp-gpus", "dense", {"rollout_gpus": 6, "rollout_tp_size": 4}, "rollout_gpus", IC, "rollout.tp_divides_gpus"),
    ("rollout-tp-heads", "dense", {"rollout_tp_size": 8}, "rollout_tp_size", IC, "rollout.tp_heads"),
    ("rollout-tp-node", "dense", {"cluster.num_nodes": 8, "cluster.gpus_per_node": 2, "rollout_tp_size": 4},
     "rollout_tp_size", NI, "rollout.tp_within_node"),
    ("endpoints-required", "dense", {f"{GRP}.runtime_manage_rollout_processes": False}, "rollout_endpoints", IC,
     "rollout.endpoints_required"),
    ("endpoints-when-managed", "dense", {"rollout_endpoints": ["http://10.0.0.5:8100"]}, "rollout_endpoints", IC,
     "rollout.endpoints_unmanaged_only"),
    ("endpoint-format", "dense", {f"{GRP}.runtime_manage_rollout_processes": False, "rollout_endpoints": ["not a url"]},
     "rollout_endpoints[0]", IC, "rollout.endpoint_format"),
    ("port-range", "dense", {"rollout_port_base": 65530}, "rollout_port_base", IC, "rollout.ports"),
    ("port-collision", "dense", {"tracking.backends": ["prometheus"], "tracking.prometheus_port": 8101},
     "tracking.prometheus_port", IC, "rollout.ports"),
    ("sync-nccl", "dense", {"rollout_weight_sync_mode": "nccl"}, "rollout_weight_sync_mode", NI, "sync.nccl"),
    ("offpolicy-vs-interval", "dense", {"sync_interval": 3}, "max_head_offpolicyness", IC,
     "sync.offpolicy_covers_interval"),
    ("backend-fsdp", "dense", {"train_backend": "fsdp"}, "train_backend", NI, "train.backend"),
    # batch geometry and lengths
    ("batch-geometry", "dense", {"batch_size": 3, "n_samples": 2}, "batch_size", IC, "batch.geometry"),
    ("batch-geometry-micro", "dense", {"train_micro_batch_size": 3}, "batch_size", IC, "batch.geometry"),
    ("recompute-micro", "dense", {"recompute_micro_batch_size": 3}, "recompute_micro_batch_size", IC,
     "batch.recompute_micro_batch"),
    ("group-norm-one-sample", "dense", {"n_samples": 1}, "n_samples", IC, "batch.group_norm_samples"),
    ("concurrency-below-group", "dense", {"max_concurrent_rollouts": 4}, "max_concurrent_rollouts", IC,
     "batch.concurrency"),
    ("new-tokens-fill-context", "dense", {"max_new_tokens": 4096}, "max_new_tokens", IC, "lengths.new_tokens"),
    ("context-above-positions", "dense", {"max_model_len": 65536}, "max_model_len", IC, "lengths.model_positions"),
    ("expected-response", "dense", {"expected_response_tokens": 2000}, "expected_response_tokens", IC,
     "lengths.expected_response"),
    # runtime planner and elastic options
    ("online-replanning-no-master", "dense", {f"{GRP}.runtime_online_replanning": True},
     f"{GRP}.runtime_online_replanning", IC, "runtime.needs_master_switch"),
    ("replanning-nothing-to-resize", "dense", {f"{GRP}.runtime_dynamic_reconfiguration_enabled": True,
                                              f"{GRP}.runtime_online_replanning": True,
                                              f"{GRP}.runtime_manage_rollout_processes": False,
                                              "rollout_endpoints": ["http://10.0.0.5:8100"]},
     f"{GRP}.runtime_online_replanning", IC, "runtime.replan_resizable_pool"),
    ("train-reconfig-no-master", "dense", {f"{GRP}.runtime_reconfigure_training": True},
     f"{GRP}.runtime_reconfigure_training", IC, "runtime.needs_master_switch"),
    ("cluster-swap-strategy", "dense", {f"{GRP}.runtime_dynamic_reconfiguration_enabled": True,
                                      f"{GRP}.runtime_rollout_reconfigure_strategy": "cluster_swap"},
     f"{GRP}.runtime_rollout_reconfigure_strategy", IC, "runtime.cluster_swap_strategy"),
    ("cluster-swap-no-training", "dense", {f"{GRP}.runtime_dynamic_reconfiguration_enabled": True,
                                         f"{GRP}.runtime_cluster_swap_enabled": True},
     f"{GRP}.runtime_cluster_swap_enabled", IC, "runtime.cluster_swap_pools"),
    ("plan-only-no-training", "dense", {f"{GRP}.runtime_dynamic_reconfiguration_enabled": True,
                                      f"{GRP}.runtime_training_pool_plan_only": True},
     f"{GRP}.runtime_training_pool_plan_only", IC, "runtime.plan_only_needs_training"),
    ("replica-size", "dense", {f"{GRP}.elastic_hybrid_replica_size_gpus": 3}, f"{GRP}.elastic_hybrid_replica_size_gpus",
     IC, "elastic.replica_size"),
    # operator API and metrics addresses
    ("api-off-loopback-no-tls", "dense", {"operator_api.bind_address": "0.0.0.0"}, "operator_api.bind_address", IC,
     "api.tls"),
    ("api-cert-without-key", "dense", {"operator_api.tls_cert_path": "{tmp}/train.jsonl"}, "operator_api.tls_key_path",
     IC, "api.tls"),
    ("api-bind-not-ip", "dense", {"operator_api.bind_address": "my-host"}, "operator_api.bind_address", IC,
     "api.bind_address"),
    ("api-port-is-prometheus", "dense", {"operator_api.port": 9400, "tracking.prometheus_port": 9400,
                                         "tracking.backends": ["jsonl", "prometheus"]}, "operator_api.port", IC,
     "api.port"),
    ("prometheus-bind-not-ip", "dense", {"tracking.prometheus_bind_address": "nowhere"},
     "tracking.prometheus_bind_address", IC, "tracking.bind_address"),
    ("elastic-min-rollout", "dense", {f"{GRP}.elastic_hybrid_min_rollout_gpus": 17},
     f"{GRP}.elastic_hybrid_min_rollout_gpus", IC, "elastic.min_rollout"),
    ("ehp-expert-parallel", "moe", {**EHP_ON, f"{GRP}.elastic_hybrid_replica_size_gpus": 8}, "train_ep_size", NI,
     "elastic.ehp_expert_parallel"),
    # algorithm, optimizer, Megatron-Core
    ("is-without-recompute", "dense", {"algorithm.is_correction.enable": True, "recompute_logprobs": False},
     "algorithm.is_correction.enable", IC, "algo.is_needs_recompute"),
    ("offload-fraction-alone", "dense", {"megatron_optimizer_offload_fraction": 0.5},
     "megatron_optimizer_offload_fraction", IC, "megatron.offload_fraction"),
    ("offload-zero-fraction", "dense", {"megatron_optimizer_cpu_offload": True,
                                      "megatron_use_precision_aware_optimizer": True,
                                      "megatron_use_distributed_optimizer": True},
     "megatron_optimizer_offload_fraction", IC, "megatron.offload_fraction"),
    ("offload-needs-precision-aware", "dense", {"megatron_optimizer_cpu_offload": True,
                                              "megatron_optimizer_offload_fraction": 1.0},
     "megatron_optimizer_cpu_offload", IC, "megatron.offload_needs_precision_aware"),
    ("precision-aware-needs-distributed", "dense", {"megatron_use_precision_aware_optimizer": True},
     "megatron_use_precision_aware_optimizer", IC, "megatron.precision_aware_needs_distributed"),
    ("min-lr-above-lr", "dense", {"optimizer.min_lr": 1.0e-3}, "optimizer.min_lr", IC, "optim.min_lr"),
    ("warmup-beyond-steps", "dense", {"optimizer.lr_warmup_steps": 200}, "optimizer.lr_warmup_steps", IC, "optim.warmup"),
    # CPU platform
    ("cpu-context-parallel", "cpu", {"train_cp_size": 2}, "train_cp_size", NV, "cpu.context_parallel"),
    ("cpu-allowed-cp", "cpu", {f"{GRP}.allowed_train_cp": [1, 2]}, f"{GRP}.allowed_train_cp", NV,
     "cpu.context_parallel"),
    ("cpu-distributed-optimizer", "cpu", {"megatron_use_distributed_optimizer": True},
     "megatron_use_distributed_optimizer", NV, "cpu.distributed_optimizer"),
    ("cpu-clip-grad", "cpu", {"optimizer.clip_grad": 1.0}, "optimizer.clip_grad", NV, "cpu.clip_grad"),
    ("cpu-grouped-gemm", "cpu", {"megatron_grouped_gemm": True}, "megatron_grouped_gemm", NV, "cpu.grouped_gemm"),
    ("cpu-initialization", "cpu", {"megatron_use_cpu_initialization": False}, "megatron_use_cpu_initialization", IC,
     "cpu.cpu_initialization"),
    ("cpu-head-dim", "cpu", {"build_tiny_model.hidden_size": 64}, "build_tiny_model.num_heads", NV,
     "cpu.attention_head_dim"),
    ("cpu-kv-cache", "cpu", {"rollout_kv_cache_bytes": 0}, "rollout_kv_cache_bytes", IC, "cpu.kv_cache_bytes"),
    ("drift-budget-above-max-new-tokens", "cpu", {"task.name": "drift"}, "task.params.end_tokens", IC,
     "task.drift_budget"),
    ("metered-real-gpus", "dense", {"cluster.metered_cpu_per_gpu": 0.5}, "cluster.metered_cpu_per_gpu", IC,
     "cpu.metered_logical"),
    ("metered-below-kernel-minimum", "cpu", {"cluster.metered_cpu_per_gpu": 0.001}, "cluster.metered_cpu_per_gpu",
     IC, "cpu.metered_logical"),
    ("metered-below-one-ms-per-20ms-period", "cpu", {"cluster.metered_cpu_per_gpu": 0.04},
     "cluster.metered_cpu_per_gpu", IC, "cpu.metered_logical"),
    ("metered-no-cpu-controller", "cpu", {"cluster.metered_cpu_per_gpu": 0.25, "cluster.metered_cgroup_root": "{tmp}"},
     "cluster.metered_cpu_per_gpu", NV, "cpu.metering_controller"),
    # task, files, checkpoint, tracking, tiny model
    ("dataset-without-path", "dense", {"task.name": "dataset"}, "task.dataset_path", IC, "task.builds"),
    ("dataset-missing-file", "dense", {"task.name": "dataset", "task.dataset_path": "/nonexistent/train.jsonl"},
     "task.dataset_path", IC, "task.builds"),
    ("dataset-format", "dense", {"task.name": "dataset", "task.dataset_path": "{tmp}/train.csv"}, "task.dataset_path", IC,
     "task.builds"),
    ("eval-without-data", "dense", {"task.name": "dataset", "task.dataset_path": "{tmp}/train.jsonl",
                                  "task.eval_interval": 10}, "task.eval_interval", IC, "task.builds"),
    ("dataset-all-eval", "dense", {"task.name": "dataset", "task.dataset_path": "{tmp}/train.jsonl",
                                 "task.eval_dataset_path": "{tmp}/train.jsonl"}, "task.eval_dataset_path", IC,
     "task.builds"),
    ("dataset-input-key", "dense", {"task.name": "dataset", "task.dataset_path": "{tmp}/train.jsonl",
                                  "task.input_key": "question"}, "task.input_key", IC, "task.builds"),
    ("dataset-few-prompts", "dense", {"task.name": "dataset", "task.dataset_path": "{tmp}/train.jsonl@[0:10]"},
     "batch_size", IC, "task.builds"),
    ("reward-unknown", "dense", {"task.reward": "exact"}, "task.reward", IC, "task.builds"),
    ("task-param-unknown", "dense", {"task.params": {"modulos": 7}}, "task.params.modulos", IC, "task.builds"),
    ("task-param-value", "dense", {"task.params": {"modulus": 1}}, "task.params.modulus", IC, "task.builds"),
    ("tokenizer-missing", "dense", {"tokenizer_path": "/nonexistent/tokenizer"}, "tokenizer_path", IC, "model.tokenizer"),
    ("tokenizer-no-files", "dense", {"tokenizer_path": "{tmp}/notamodel"}, "tokenizer_path", IC, "model.tokenizer"),
    ("keep-every-no-interval", "dense", {"checkpoint.keep_every": 10}, "checkpoint.keep_every", IC,
     "checkpoint.keep_every"),
    ("keep-every-multiple", "dense", {"checkpoint.interval_steps": 20, "checkpoint.keep_every": 30},
     "checkpoint.keep_every", IC, "checkpoint.keep_every"),
    ("mirror-in-checkpoints", "dense", {"run_dir": "{tmp}/run", "checkpoint.mirror_dir": "{tmp}/run/checkpoints/copy"},
     "checkpoint.mirror_dir", IC, "checkpoint.mirror_dir"),
    ("mirror-is-run-dir", "dense", {"run_dir": "{tmp}/run", "checkpoint.mirror_dir": "{tmp}/run"},
     "checkpoint.mirror_dir", IC, "checkpoint.mirror_dir"),
    ("mirror-under-a-file", "dense", {"checkpoint.mirror_dir": "{tmp}/train.jsonl/mirror"}, "checkpoint.mirror_dir",
     IC, "checkpoint.mirror_dir"),
    ("prometheus-no-port", "dense", {"tracking.backends": ["jsonl", "prometheus"]}, "tracking.prometheus_port", IC,
     "tracking.prometheus_port"),
    ("tracking-duplicate", "dense", {"tracking.backends": ["jsonl", "jsonl"]}, "tracking.backends", IC, "tracking.unique"),
    ("tiny-kv-heads", "cpu", {"build_tiny_model.num_kv_heads": 3}, "build_tiny_model.num_kv_heads", IC, "tiny.shape"),
    ("tiny-into-non-model-dir", "cpu", {"model_path": "{tmp}/notamodel"}, "model_path", IC, "tiny.target_dir"),
]

# Options nothing acts on yet: each is refused as Not implemented when set (one rule per option, `unwired.*`).
UNWIRED_VALUES: dict[str, Any] = {
    "runtime_dynamic_reconfiguration_enabled": True, "runtime_online_replanning": True,
    "runtime_rollout_reconfigure_strategy": "restart_all", "runtime_cluster_swap_enabled": True,
    "runtime_reconfigure_training": True, "runtime_training_pool_plan_only": True,
    "decouple_communication_domains": True, "elastic_hybrid_replica_size_gpus": 4,
    "elastic_hybrid_min_rollout_gpus": 4, "replan_interval_steps": 5, "replan_min_gain": 0.2,
}
BAD += [(f"unwired-{u.option}", "dense", {f"{GRP}.{u.option}": UNWIRED_VALUES[u.option]}, f"{GRP}.{u.option}", NI,
         f"unwired.{u.option}") for u in UNWIRED]
BAD += [
    ("context-parallel", "dense", {"train_cp_size": 2}, "train_cp_size", NI, "train.context_parallel"),
    ("allowed-context-parallel", "dense", {f"{GRP}.allowed_train_cp": [1, 2]}, f"{GRP}.allowed_train_cp", NI,
     "train.context_parallel"),
]

# (id, base, changes, expected warning rule id)
WARN: list[tuple[str, str, dict[str, Any], str]] = [
    ("tp-across-nodes", "dense", {"cluster.num_nodes": 8, "cluster.gpus_per_node": 2, "train_tp_size": 4},
     "layout.tp_within_node"),
    ("allowed-tp-pruned", "dense", {f"{GRP}.allowed_train_tp": [1, 2, 8]}, "planner.allowed_pruned"),
    ("allowed-ep-pruned", "moe", {f"{GRP}.allowed_train_ep": [1, 2, 4, 8, 256]}, "planner.allowed_pruned"),
    ("strategy-without-master", "dense", {f"{GRP}.runtime_rollout_reconfigure_strategy": "restart_all"},
     "runtime.strategy_ignored"),
    ("replan-without-online", "dense", {f"{GRP}.replan_interval_steps": 5}, "runtime.replan_ignored"),
    ("replan-interval-beyond-job", "dense", {f"{GRP}.runtime_dynamic_reconfiguration_enabled": True,
                                            f"{GRP}.runtime_online_replanning": True,
                                            f"{GRP}.replan_interval_steps": 100000}, "runtime.replan_interval"),
    ("unmanaged-resize", "dense", {f"{GRP}.runtime_dynamic_reconfiguration_enabled": True,
                                 f"{GRP}.runtime_manage_rollout_processes": False,
                                 "rollout_endpoints": ["http://10.0.0.5:8100"]}, "runtime.unmanaged_rollout"),
    ("min-lr-constant-lr", "dense", {"optimizer.min_lr": 1.0e-7}, "optim.min_lr_needs_decay"),
    ("deprecated-max-workers", "dense", {f"{GRP}.elastic_hybrid_max_workers": 4}, "options.deprecated"),
    ("decouple-without-training", "dense", {f"{GRP}.decouple_communication_domains": True},
     "elastic.decouple_needs_training"),
    ("decouple-in-async-job", "dense", {**EHP_ON, "max_head_offpolicyness": 1,
                                      f"{GRP}.decouple_communication_domains": True}, "elastic.decouple_needs_training"),
    ("ehp-min-rollout-without-size", "dense", {f"{GRP}.elastic_hybrid_min_rollout_gpus": 4},
     "elastic.ehp_options_ignored"),
    ("ehp-size-in-async-job", "dense", {**EHP_ON, "max_head_offpolicyness": 1}, "elastic.ehp_options_ignored"),
    ("ehp-size-without-training-changes", "dense", {f"{GRP}.elastic_hybrid_replica_size_gpus": 2},
     "elastic.ehp_options_ignored"),
    ("ehp-min-rollout-leaves-no-replica", "dense", {**EHP_ON, f"{GRP}.elastic_hybrid_min_rollout_gpus": 7},
     "elastic.ehp_options_ignored"),
    ("ref-kl-zero-coef", "dense", {"algorithm.ref_kl.enable": True, "algorithm.ref_kl.coef": 0.0}, "algo.ref_kl_coef"),
    ("disabled-ref-kl-options", "dense", {"algorithm.ref_kl.coef": 0.01}, "algo.disabled_options"),
    ("greedy-groups", "dense", {"rollout_temperature": 0.0}, "algo.temperature_zero"),
    ("grouped-gemm-dense", "dense", {"megatron_grouped_gemm": True}, "megatron.grouped_gemm_dense"),
    ("dry-run-without-recompute", "dense", {f"{GRP}.memory_budget_dry_run_enabled": True, "recompute_logprobs": False},
     "memory.dry_run_needs_recompute"),
    ("recompute-mb-ignored", "dense", {"recompute_logprobs": False, "recompute_micro_batch_size": 2},
     "memory.recompute_options_ignored"),
    ("cpu-memory-utilization", "cpu", {"rollout_gpu_memory_utilization": 0.5}, "cpu.memory_utilization_ignored"),
    ("builtin-task-dataset", "dense", {"task.dataset_path": "{tmp}/train.jsonl"}, "task.builtin_ignores_dataset"),
    ("port-without-backend", "dense", {"tracking.prometheus_port": 9400}, "tracking.port_unused"),
    ("blue-green-no-spare", "dense", {f"{GRP}.runtime_dynamic_reconfiguration_enabled": True,
                                    f"{GRP}.runtime_rollout_reconfigure_strategy": "blue_green"},
     "runtime.spare_gpus"),
    ("metered-root-unused", "cpu", {"cluster.metered_cgroup_root": "/sys/fs/cgroup/cpu"}, "cpu.metered_root_ignored"),
]


@pytest.mark.parametrize("base", ["dense", "moe", "cpu"])
def test_bases_are_valid(base: str, tmp_path: Path) -> None:
    cfg = load_dict(base_for(base, tmp_path))
    assert cfg.warnings == []


# Cases whose rule sits behind a refusal: the option it reads is refused first (Not implemented), so the rule
# only runs once that refusal is lifted. case id -> the refusing rule; the change that wires the option removes
# its rule and these entries.
BEHIND: dict[str, tuple[str, ...]] = {
    "cp-sequence": ("train.context_parallel",),
    "cpu-context-parallel": ("train.context_parallel",),
    "cpu-allowed-cp": ("train.context_parallel",),
}
ACTIVE_BAD = [c for c in BAD if c[0] not in BEHIND]
ACTIVE_WARN = [c for c in WARN if c[0] not in BEHIND]


def _without(rule_ids: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """Validate with the rules `rule_ids` lifted from the table."""
    gone = set(rule_ids) - {r.id for r in RULES}
    assert not gone, f"{gone} are gone: move their BEHIND cases back to the plain corpus"
    monkeypatch.setattr(loader, "run_rules", functools.partial(run_rules, rules=[r for r in RULES if r.id not in rule_ids]))


@pytest.mark.parametrize("case", [c for c in BAD + WARN if c[0] in BEHIND], ids=lambda c: c[0])  # type: ignore[misc]
def test_rules_behind_a_refusal(case: tuple[Any, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As configured, the case gives exactly one error, the refusal; with the refusal lifted, its own rule fires."""
    make_files(tmp_path)
    data = with_changes(base_for(case[1], tmp_path), case[2], tmp_path)
    with pytest.raises(ConfigError) as info:
        load_dict(data)
    assert [e.rule_id for e in info.value.errors] == list(BEHIND[case[0]]), "\n".join(map(str, info.value.errors))
    _without(BEHIND[case[0]], monkeypatch)
    if len(case) == 4:
        cfg = load_dict(data)
        assert [w for w in cfg.warnings if w.endswith(f"[{case[3]}]")], cfg.warnings
        return
    with pytest.raises(ConfigError) as info:
        load_dict(data)
    assert [(e.path, e.kind, e.rule_id) for e in info.value.errors] == [tuple(case[3:])]


@pytest.mark.parametrize(("base", "changes", "path", "kind", "rule_id"), [c[1:] for c in ACTIVE_BAD],
                         ids=[c[0] for c in ACTIVE_BAD])
def test_one_mistake_gives_one_error(base: str, changes: dict[str, Any], path: str, kind: str, rule_id: str,
                                     tmp_path: Path) -> None:
    make_files(tmp_path)
    data = with_changes(base_for(base, tmp_path), changes, tmp_path)
    with pytest.raises(ConfigError) as info:
        load_dict(data)
    errors = info.value.errors
    assert len(errors) == 1, "\n".join(map(str, errors))
    issue = errors[0]
    assert (issue.path, issue.kind, issue.rule_id) == (path, kind, rule_id), str(issue)
    assert issue.fix.strip() and issue.rule.strip()
    text = str(issue)
    assert text.startswith(f"{kind}: {path} = ") and "Fix: " in text


@pytest.mark.parametrize(("base", "changes", "rule_id"), [c[1:] for c in ACTIVE_WARN], ids=[c[0] for c in ACTIVE_WARN])
def test_warning_rules_warn_and_never_fail(base: str, changes: dict[str, Any], rule_id: str, tmp_path: Path) -> None:
    make_files(tmp_path)
    cfg = load_dict(with_changes(base_for(base, tmp_path), changes, tmp_path))
    assert [w for w in cfg.warnings if w.endswith(f"[{rule_id}]")], cfg.warnings
    assert all("Fix: " in w for w in cfg.warnings)


def test_every_rule_has_a_corpus_case() -> None:
    covered = {c[5] for c in BAD} | {c[3] for c in WARN}
    missing = [r.id for r in RULES if r.id not in covered]
    assert missing == []


def test_rule_table_is_well_formed() -> None:
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids))
    for rule in RULES:
        assert rule.kind in (INVALID, NOT_IMPLEMENTED, NOT_VALIDATED, WARNING)
        assert rule.fields and rule.summary


def test_corpus_is_large_enough() -> None:
    assert len(BAD) >= 40
