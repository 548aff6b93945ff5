"""Where every configuration option arrives: the registry `CONSUMERS` (option path -> its consumers), the
short list of options that are refused or warned about by a named rule instead (`rule <id>` entries), and the
named exemptions (`EXEMPT`).

A consumer is written as one of:
- `TrainingPoolSpec.<field...>`, `RolloutPoolSpec.<field>`: the pool specs the controller builds
  (`libra.controller.pools.training_spec` / `rollout_spec`, through `libra.config.mapping`);
- `TinyModelSpec.<field>`: the tiny model the launcher builds (`mapping.tiny_model_spec`);
- `PlannerInputs.<part>.<field>`: what the planner is given (`libra.planning.planner_inputs`);
- `DesiredState.<field>`: the controller's first desired state (`libra.controller.allocation`);
- `TaskSpec.<field>`: the task the data package builds (`libra.data.registry.TaskSpec.from_config`);
- `reads <module>:<qualname>`: code that reads the option where it acts (the RL loop, the controller's
  logging, tracking and Ray start-up);
- `rule <id>`: an option that `libra validate` refuses (Not implemented) or warns about when set.

A trailing `~` marks a consumer that derives its value (e.g. `megatron_params_dtype` -> bytes per
parameter): a change of the option must change it, not necessarily to the same value.
`tests/unit/config/test_field_coverage.py` walks every option of `Config` and checks each entry for real: it
changes the option and asserts the spec or planner input changes, or that the named code reads it.
"""

from __future__ import annotations

from libra.config.checks_runtime import UNWIRED

TRAIN = "TrainingPoolSpec"
ROLLOUT = "RolloutPoolSpec"
RL_LOOP = "reads libra.controller.rl_loop:RLLoop"
CONTROLLER = "reads libra.controller.controller:Controller"
START_RAY = "reads libra.controller.bootstrap:start_ray"
OPERATOR_API = "reads libra.api.server:start_operator_api"
REPLANNER = "reads libra.controller.replanner:build_replanner"
REPLAN_SETTINGS = "reads libra.controller.replanner:ReplanSettings.from_config"
EHP_SETTINGS = "reads libra.training.ehp:EhpSettings.from_planner_options"
NODE_LOSS = "reads libra.controller.node_loss:NodeLossRecovery"
GRP = "global_resource_planner."

CONSUMERS: dict[str, tuple[str, ...]] = {
    "name": (CONTROLLER,),
    "run_dir": ("reads libra.cli.cmd_launch:run",),
    "log_level": (CONTROLLER,),
    "seed": (f"{TRAIN}.seed", f"{ROLLOUT}.seed", RL_LOOP),
    "total_steps": (CONTROLLER, f"{TRAIN}.optimizer.lr_decay_steps"),
    "model_path": (f"{TRAIN}.model_path", f"{ROLLOUT}.model_path"),
    "tokenizer_path": ("reads libra.controller.bootstrap:load_tokenizer",),
    "train_backend": ("rule train.backend",),
    "train_gpus": ("DesiredState.train_gpus", "PlannerInputs.space.pinned~"),
    "rollout_gpus": ("DesiredState.rollout_instances~", "PlannerInputs.space.pinned~"),
    "train_tp_size": (f"{TRAIN}.tp", "PlannerInputs.space.pinned.tp"),
    "train_pp_size": (f"{TRAIN}.pp", "PlannerInputs.space.pinned.pp"),
    "train_cp_size": (f"{TRAIN}.cp", "PlannerInputs.space.pinned.cp"),
    "train_ep_size": (f"{TRAIN}.ep", "PlannerInputs.space.pinned.ep"),
    "train_vpp_size": (f"{TRAIN}.vpp", "PlannerInputs.train.vpp"),
    "train_micro_batch_size": (f"{TRAIN}.micro_batch_size", "PlannerInputs.workload.train_micro_batch_size"),
    "batch_size": ("PlannerInputs.workload.batch_size", f"{ROLLOUT}.max_concurrent_requests~", RL_LOOP),
    "n_samples": ("PlannerInputs.workload.n_samples", f"{ROLLOUT}.max_concurrent_requests~", RL_LOOP),
    "max_model_len": (f"{ROLLOUT}.max_model_len", "PlannerInputs.workload.max_model_len"),
    "max_new_tokens": ("PlannerInputs.workload.max_new_tokens", RL_LOOP),
    "max_concurrent_rollouts": (f"{ROLLOUT}.max_concurrent_requests", "PlannerInputs.workload.max_concurrent_rollouts"),
    "max_head_offpolicyness": ("PlannerInputs.workload.max_head_offpolicyness", RL_LOOP),
    "recompute_logprobs": (f"{TRAIN}.recompute_logprobs", "PlannerInputs.workload.recompute_logprobs"),
    "recompute_micro_batch_size": (f"{TRAIN}.recompute_micro_batch_size",
                                   "PlannerInputs.workload.recompute_micro_batch_size"),
    "phase_trace_enabled": (CONTROLLER,),
    "sync_interval": ("PlannerInputs.workload.sync_interval", RL_LOOP),
    "rollout_weight_sync_mode": ("rule sync.nccl",),
    "rollout_weight_reload_method": (f"{ROLLOUT}.reload_method", "PlannerInputs.rollout.reload_method"),
    "rollout_weight_reload_strategy": (f"{ROLLOUT}.reload_strategy",),
    "rollout_tp_size": (f"{ROLLOUT}.tp_size", "DesiredState.rollout_tp", "PlannerInputs.space.pinned.rollout_tp"),
    "rollout_endpoints": (f"{ROLLOUT}.endpoints",),
    "rollout_kv_cache_bytes": (f"{ROLLOUT}.kv_cache_bytes", "PlannerInputs.rollout.kv_cache_bytes"),
    "rollout_gpu_memory_utilization": (f"{ROLLOUT}.gpu_memory_utilization",
                                       "PlannerInputs.rollout.gpu_memory_utilization"),
    "rollout_port_base": (f"{ROLLOUT}.port_base",),
    "rollout_enforce_eager": (f"{ROLLOUT}.enforce_eager",),
    "rollout_health_check_interval_s": (f"{ROLLOUT}.health.interval_s",),
    "rollout_health_check_timeout_s": (f"{ROLLOUT}.health.timeout_s",),
    "rollout_health_check_failures": (f"{ROLLOUT}.health.failures_to_fail",),
    "rollout_stall_timeout_s": (f"{ROLLOUT}.health.stall_s",),
    "restart_backoff_s": (CONTROLLER,),
    "train_hang_timeout_s": (f"{TRAIN}.hang.timeout_s",),
    "train_hang_timeout_factor": (f"{TRAIN}.hang.factor",),
    "rollout_temperature": (RL_LOOP,),
    "rollout_top_p": (RL_LOOP,),
    "expected_response_tokens": ("PlannerInputs.workload.expected_response_tokens",),
    "megatron_use_precision_aware_optimizer": (f"{TRAIN}.megatron.use_precision_aware_optimizer",
                                               "PlannerInputs.train.precision_aware_optimizer"),
    "megatron_optimizer_cpu_offload": (f"{TRAIN}.megatron.optimizer_cpu_offload",
                                       "PlannerInputs.train.optimizer_cpu_offload"),
    "megatron_optimizer_offload_fraction": (f"{TRAIN}.megatron.optimizer_offload_fraction",
                                            "PlannerInputs.train.optimizer_offload_fraction"),
    "megatron_use_cpu_initialization": (f"{TRAIN}.megatron.use_cpu_initialization",),
    "megatron_grouped_gemm": (f"{TRAIN}.megatron.grouped_gemm",),
    "megatron_use_distributed_optimizer": (f"{TRAIN}.megatron.use_distributed_optimizer",
                                           "PlannerInputs.train.use_distributed_optimizer"),
    "megatron_recompute_granularity": (f"{TRAIN}.megatron.recompute_granularity",
                                       "PlannerInputs.train.recompute_granularity"),
    "megatron_params_dtype": (f"{TRAIN}.params_dtype", "PlannerInputs.train.params_dtype_bytes~"),
    # cluster
    "cluster.num_nodes": ("PlannerInputs.cluster.num_nodes", START_RAY),
    "cluster.gpus_per_node": ("PlannerInputs.cluster.gpus_per_node", START_RAY),
    "cluster.gpu_type": ("PlannerInputs.cluster.gpu~",),
    "cluster.logical_gpus": ("PlannerInputs.train.attention_backend~",),
    "cluster.ray_address": (START_RAY,),
    "cluster.cpus_per_gpu": (START_RAY,),
    "cluster.metered_cpu_per_gpu": (f"{TRAIN}.metering.cores_per_gpu", f"{ROLLOUT}.metering.cores_per_gpu"),
    "cluster.metered_cgroup_root": (f"{TRAIN}.metering.cgroup_root", f"{ROLLOUT}.metering.cgroup_root"),
    **{f"cluster.gpu_spec.{name}": ("PlannerInputs.cluster.gpu~",) for name in (
        "name", "memory_gb", "bf16_dense_tflops", "hbm_tb_per_s", "intra_node_gb_per_s", "inter_node_gb_per_s")},
    # global_resource_planner
    f"{GRP}memory_budget_check_enabled": ("PlannerInputs.budget.check_enabled",),
    f"{GRP}memory_budget_dry_run_enabled": (CONTROLLER,),
    f"{GRP}memory_budget_safety_margin_bytes": ("PlannerInputs.budget.safety_margin_bytes",),
    f"{GRP}memory_budget_logits_dtype_bytes": ("PlannerInputs.budget.logits_dtype_bytes",),
    f"{GRP}memory_budget_workspace_factor": ("PlannerInputs.budget.workspace_factor",),
    f"{GRP}initial_allocation_strategy": ("PlannerInputs.space.strategy",),
    f"{GRP}allocation_granularity_gpus": ("PlannerInputs.space.allocation_granularity_gpus",),
    f"{GRP}min_train_gpus": ("PlannerInputs.space.min_train_gpus", NODE_LOSS),
    f"{GRP}min_rollout_gpus": ("PlannerInputs.space.min_rollout_gpus", NODE_LOSS),
    f"{GRP}runtime_node_loss_policy": (NODE_LOSS,),
    f"{GRP}runtime_node_loss_wait_s": (NODE_LOSS,),
    f"{GRP}runtime_training_restart_limit": (RL_LOOP,),
    f"{GRP}allowed_train_tp": ("PlannerInputs.space.allowed_tp~",),
    f"{GRP}allowed_train_ep": ("PlannerInputs.space.allowed_ep~",),
    f"{GRP}allowed_train_pp": ("PlannerInputs.space.allowed_pp~",),
    f"{GRP}allowed_train_cp": ("PlannerInputs.space.allowed_cp~",),
    f"{GRP}train_comm_compute_ratio_threshold": ("PlannerInputs.space.comm_compute_ratio_threshold",),
    f"{GRP}train_ep_comm_compute_ratio_threshold": ("PlannerInputs.space.ep_comm_compute_ratio_threshold",),
    f"{GRP}train_pipeline_bubble_ratio_threshold": ("PlannerInputs.space.bubble_ratio_threshold",),
    f"{GRP}runtime_manage_rollout_processes": (f"{ROLLOUT}.manage_processes",),
    f"{GRP}runtime_batch_collection_timeout_s": (RL_LOOP,),
    f"{GRP}runtime_batch_collection_max_retries": (RL_LOOP,),
    f"{GRP}runtime_drain_before_reconfigure": ("DesiredState.drain_before_stop",),
    f"{GRP}runtime_dynamic_reconfiguration_enabled": (CONTROLLER,),
    f"{GRP}runtime_rollout_reconfigure_strategy": ("DesiredState.reconfigure_strategy",),
    f"{GRP}runtime_reconfigure_training": (CONTROLLER, REPLAN_SETTINGS,  # Controller.reconfigure_limits
                                           "reads libra.config.elastic_hybrid:ehp_switch"),
    f"{GRP}runtime_training_pool_plan_only": (CONTROLLER,),
    f"{GRP}runtime_cluster_swap_enabled": ("DesiredState.cluster_swap_enabled", CONTROLLER),
    f"{GRP}runtime_online_replanning": (REPLANNER,),
    f"{GRP}replan_interval_steps": (REPLAN_SETTINGS,),
    f"{GRP}replan_min_gain": (REPLAN_SETTINGS,),
    f"{GRP}elastic_hybrid_max_workers": ("rule options.deprecated",),
    # elastic hybrid parallelism: the borrowing session's settings, and the validation's replica size
    f"{GRP}decouple_communication_domains": (EHP_SETTINGS,),
    f"{GRP}elastic_hybrid_replica_size_gpus": (EHP_SETTINGS, "reads libra.config.elastic_hybrid:replica_size"),
    f"{GRP}elastic_hybrid_min_rollout_gpus": (EHP_SETTINGS,),
    **{f"{GRP}{u.option}": (f"rule unwired.{u.option}",) for u in UNWIRED},
    # algorithm
    "algorithm.advantage_norm_mode": (f"{TRAIN}.algorithm.advantage_norm_mode", RL_LOOP),
    "algorithm.loss_agg_mode": (f"{TRAIN}.algorithm.loss_agg_mode",),
    "algorithm.clip_ratio_low": (f"{TRAIN}.algorithm.clip_ratio_low",),
    "algorithm.clip_ratio_high": (f"{TRAIN}.algorithm.clip_ratio_high",),
    "algorithm.clip_ratio_c": (f"{TRAIN}.algorithm.clip_ratio_c",),
    "algorithm.entropy_coef": (f"{TRAIN}.algorithm.entropy_coef",),
    "algorithm.ref_kl.enable": (f"{TRAIN}.algorithm.ref_kl.enable",),
    "algorithm.ref_kl.coef": (f"{TRAIN}.algorithm.ref_kl.coef",),
    "algorithm.ref_kl.kl_type": (f"{TRAIN}.algorithm.ref_kl.kl_type",),
    "algorithm.is_correction.enable": (f"{TRAIN}.algorithm.is_correction.enable",),
    "algorithm.is_correction.level": (f"{TRAIN}.algorithm.is_correction.level",),
    "algorithm.is_correction.action": (f"{TRAIN}.algorithm.is_correction.action",),
    "algorithm.is_correction.lower_bound": (f"{TRAIN}.algorithm.is_correction.lower_bound",),
    "algorithm.is_correction.upper_bound": (f"{TRAIN}.algorithm.is_correction.upper_bound",),
    # optimizer
    **{f"optimizer.{name}": (f"{TRAIN}.optimizer.{name}",) for name in (
        "lr", "min_lr", "lr_warmup_steps", "lr_decay_style", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")},
    # task
    **{f"task.{name}": (f"TaskSpec.{name}",) for name in (
        "name", "dataset_path", "eval_dataset_path", "input_key", "label_key", "reward", "params")},
    "task.eval_interval": (RL_LOOP,),
    "task.eval_size": (RL_LOOP,),
    # checkpoint
    "checkpoint.interval_steps": (RL_LOOP,),
    "checkpoint.keep_last": (f"{TRAIN}.retention.keep_last~", RL_LOOP),
    "checkpoint.keep_every": (f"{TRAIN}.retention.keep_every", RL_LOOP),
    "checkpoint.resume": (RL_LOOP,),
    "checkpoint.mirror_dir": (RL_LOOP,),
    # tracking
    "tracking.backends": (CONTROLLER,),
    "tracking.prometheus_port": (CONTROLLER,),
    "tracking.console": (CONTROLLER,),
    "tracking.prometheus_bind_address": (CONTROLLER,),
    # operator API
    **{f"operator_api.{name}": (OPERATOR_API,) for name in (
        "enabled", "bind_address", "port", "tls_cert_path", "tls_key_path")},
    # tiny model
    "build_tiny_model.enabled": ("reads libra.controller.bootstrap:ensure_tiny_model",),
    **{f"build_tiny_model.{name}": (f"TinyModelSpec.{name}",) for name in (
        "arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
        "max_position_embeddings", "init_std", "seed")},
}

# Options with no consumer, each with the reason. Keep this list short: an option that does something needs
# a consumer above, and one that does nothing is refused by a rule.
EXEMPT: dict[str, str] = {
    "algorithm.advantage_estimator": "a single choice (grpo), the only estimator: there is nothing to pass on",
    "algorithm.policy_loss": "a single choice (grpo), the only policy loss: there is nothing to pass on",
}
