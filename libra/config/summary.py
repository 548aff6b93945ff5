"""A short human summary of a resolved configuration (model, cluster, split, layout, batch geometry,
warnings), printed by `libra validate` and at launch."""

from __future__ import annotations

from libra.config.checks_runtime import unwired_requested
from libra.config.elastic_hybrid import ehp_switch, replica_size
from libra.config.schema import Config
from planner.model_spec import ModelSpec, ModelSpecError


def _params(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _model_line(cfg: Config) -> str:
    try:
        spec: ModelSpec = cfg.model_spec()
    except (ModelSpecError, OSError, ValueError):
        return cfg.model_dir()
    kind = f"MoE {spec.num_experts} experts top-{spec.num_experts_per_tok}, " if spec.is_moe else ""
    origin = " (built by the launcher)" if cfg.build_tiny_model.enabled else ""
    return (f"{spec.name} [{spec.model_type}, {kind}{spec.num_layers} layers, hidden {spec.hidden_size}, "
            f"{spec.num_attention_heads} heads / {spec.num_kv_heads} KV, {_params(spec.total_params)} params]"
            f"{origin} at {cfg.model_dir()}")


def strategy_fallback(cfg: Config) -> str:
    """Why the configured rollout reconfigure strategy will run as `diff` ("" when it will not): blue_green and
    prewarm start the target set beside the serving one on spare GPUs, and fall back to diff without them."""
    p = cfg.global_resource_planner
    name = p.runtime_rollout_reconfigure_strategy
    if not p.runtime_dynamic_reconfiguration_enabled or name not in ("blue_green", "prewarm"):
        return ""
    tp = cfg.rollout_tp_size
    if not (cfg.train_gpus and cfg.rollout_gpus):
        return (f"{name} falls back to diff if the planner's split leaves fewer spare GPUs than its target set "
                f"needs (it starts beside the serving set)")
    spare = cfg.total_gpus - cfg.train_gpus - cfg.rollout_gpus
    split = f"train {cfg.train_gpus} + rollout {cfg.rollout_gpus} of {cfg.total_gpus} GPUs"
    if spare < tp:
        return (f"{name} falls back to diff: {split} leaves {spare} spare, and {name} starts the target set "
                f"beside the serving one on spare GPUs")
    if spare < cfg.rollout_gpus:
        return (f"{name} falls back to diff for a target of more than {spare // tp} instance(s) of TP{tp}: "
                f"{split} leaves {spare} spare GPUs for the target set")
    return ""


def summarize(cfg: Config) -> list[str]:
    """Lines describing the resolved configuration."""
    p = cfg.global_resource_planner
    cl = cfg.cluster
    kind = "logical GPUs" if cl.logical_gpus else "GPUs"
    strategy = p.initial_allocation_strategy
    split = (f"train {cfg.train_gpus or 'planner'} + rollout {cfg.rollout_gpus or 'planner'} "
             f"of {cfg.total_gpus} (initial_allocation_strategy {strategy}"
             + ("; the planner may change it" if strategy == "grp" else "; pinned") + ")")
    dp = cfg.train_dp_size if cfg.train_gpus else 0
    rollout = (f"rollout TP{cfg.rollout_tp_size} x {cfg.num_rollout_instances} instance(s)" if cfg.rollout_gpus
               else f"rollout TP{cfg.rollout_tp_size} (instances from the plan)")
    layout = (f"train TP{cfg.train_tp_size} PP{cfg.train_pp_size}"
              + (f"x{cfg.train_vpp_size}v" if cfg.train_vpp_size > 1 else "")
              + f" CP{cfg.train_cp_size} EP{cfg.train_ep_size} -> DP{dp or '?'}; {rollout}")
    batch = f"{cfg.batch_size} prompts x {cfg.n_samples} samples = {cfg.samples_per_step} samples/step"
    if dp:
        per_dp = cfg.samples_per_step // dp
        batch += (f"; {per_dp} per DP rank, micro batch {cfg.train_micro_batch_size} -> "
                  f"{per_dp // cfg.train_micro_batch_size} micro batches")
    if cfg.recompute_logprobs:
        batch += f"; recompute micro batch {cfg.recompute_micro_batch_size}"
    # What runs, never what is merely requested: options of the elastic runtime not wired yet are named as such
    # (the `unwired.*` rules refuse them).
    rollout_servers = ("started and replaced by Libra" if p.runtime_manage_rollout_processes
                       else f"external ({len(cfg.rollout_endpoints)} endpoint(s), never started or stopped)")
    if p.runtime_dynamic_reconfiguration_enabled:
        stop = "drained" if p.runtime_drain_before_reconfigure else "aborted, prompts requeued"
        reconfiguration = (f"on (the rollout pool is changed on request by {p.runtime_rollout_reconfigure_strategy}; "
                           f"a serving instance it stops is {stop})")
        if p.runtime_online_replanning:
            reconfiguration += (f"; re-planned online every {p.replan_interval_steps} steps "
                                f"(replan_min_gain {p.replan_min_gain:.0%})")
    else:
        reconfiguration = "off (the launch split is kept; failed rollout instances are replaced)"
    runtime = (f"{reconfiguration}; rollout servers "
               f"{rollout_servers}; batch collection {p.runtime_batch_collection_timeout_s:g} s x "
               f"{p.runtime_batch_collection_max_retries + 1} attempt(s)")
    fallback = strategy_fallback(cfg)
    if fallback:
        runtime += f"; {fallback}"
    ehp = ehp_switch(cfg)
    if ehp.acts:
        runtime += (f"; elastic hybrid parallelism {'plan only' if ehp.mode == 'plan_only' else 'on'} (training steps "
                    f"borrow idle rollout GPUs in replicas of {replica_size(cfg)}, "
                    f"{p.elastic_hybrid_min_rollout_gpus} always serving)")
    requested = unwired_requested(cfg)
    if requested:
        runtime += f"; requested but not implemented: {', '.join(requested)}"
    lines = [
        f"name       {cfg.name} (run_dir {cfg.run_dir})",
        f"model      {_model_line(cfg)}",
        f"cluster    {cl.num_nodes} node(s) x {cl.gpus_per_node} {cl.gpu_type} {kind} = {cfg.total_gpus}",
        f"split      {split}",
        f"layout     {layout}",
        f"batch      {batch}",
        f"lengths    max_model_len {cfg.max_model_len}, max_new_tokens {cfg.max_new_tokens}, "
        f"off-policy lag <= {cfg.max_head_offpolicyness}",
        f"task       {cfg.task.name}, {cfg.total_steps} steps",
        f"runtime    reconfiguration {runtime}",
    ]
    if cfg.warnings:
        lines.append(f"warnings   {len(cfg.warnings)}:")
        lines.extend(f"  {w}" for w in cfg.warnings)
    else:
        lines.append("warnings   none")
    return lines
