"""Cross-field checks of the runtime planner and elastic options, rollout endpoints and weight sync, and the
table of elastic-runtime options that are accepted by the schema but not wired to anything yet (`UNWIRED`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

from libra.config.context import Finding, RuleContext
from libra.config.elastic_hybrid import ehp_switch
from libra.config.fields import OptionInfo, options
from libra.config.schema import Config

GRP = "global_resource_planner"
MASTER = f"{GRP}.runtime_dynamic_reconfiguration_enabled"
_NEEDS_MASTER = ("runtime_online_replanning", "runtime_cluster_swap_enabled", "runtime_reconfigure_training",
                 "runtime_training_pool_plan_only")


@dataclass(frozen=True)
class Unwired:
    """An option that nothing acts on yet: `effect` is what it would do, `fix` how to run without it."""

    option: str
    effect: str
    fix: str


# `global_resource_planner` options that have no effect until the elastic runtime wires them. Each is refused
# as Not implemented when set to anything but its default (its rule id is `unwired.<option>`); the change that
# wires an option removes its entry here and its rule. runtime_manage_rollout_processes,
# runtime_batch_collection_timeout_s / _max_retries, runtime_drain_before_reconfigure,
# runtime_dynamic_reconfiguration_enabled and runtime_rollout_reconfigure_strategy (a running job is
# reconfigured through the operator API, `libra reconfigure`), runtime_reconfigure_training,
# runtime_training_pool_plan_only (training targets of such a request), runtime_cluster_swap_enabled
# (strategy cluster_swap) and runtime_online_replanning with replan_interval_steps / replan_min_gain
# (libra.controller.replanner), decouple_communication_domains and elastic_hybrid_* (elastic hybrid
# parallelism in a synchronous job, `libra.config.elastic_hybrid`) act today and are not listed.
UNWIRED: tuple[Unwired, ...] = ()


def _default_of(option: str) -> object:
    from libra.config.sections import PlannerConfig

    return options(PlannerConfig)[option].default


def unwired_requested(cfg: Config) -> list[str]:
    """The `UNWIRED` options this configuration sets to something other than their default."""
    p = cfg.global_resource_planner
    return [u.option for u in UNWIRED if getattr(p, u.option) != _default_of(u.option)]


def unwired_check(u: Unwired) -> Callable[[RuleContext], Iterator[Finding]]:
    """The check of one `UNWIRED` option: a finding when it is set to anything but its default."""

    def check(c: RuleContext) -> Iterator[Finding]:
        default = _default_of(u.option)
        if getattr(c.planner, u.option) != default:
            yield Finding(f"{GRP}.{u.option}", f"would {u.effect}, which is not implemented yet: the option is "
                          f"accepted by the schema but nothing acts on it (default {default!r})", u.fix)

    check.__name__ = f"unwired_{u.option}"
    return check


def train_context_parallel(c: RuleContext) -> Iterator[Finding]:
    why = ("the training workers build Megatron-Core's local (non-Transformer-Engine) layers, whose attention "
           "supports no context parallelism (Megatron-Core asserts when the model is built)")
    if c.cfg.train_cp_size > 1:
        yield Finding("train_cp_size", why, "set train_cp_size: 1")
    if any(cp > 1 for cp in c.planner.allowed_train_cp):
        yield Finding(f"{GRP}.allowed_train_cp", why, "use [1] (or leave it empty)")


def runtime_needs_master(c: RuleContext) -> Iterator[Finding]:
    if c.planner.runtime_dynamic_reconfiguration_enabled:
        return
    for name in _NEEDS_MASTER:
        if getattr(c.planner, name):
            yield Finding(f"{GRP}.{name}", "has no effect while runtime_dynamic_reconfiguration_enabled is false",
                          f"set {MASTER}: true, or {GRP}.{name}: false")


def cluster_swap_strategy(c: RuleContext) -> Iterator[Finding]:
    p = c.planner
    if p.runtime_rollout_reconfigure_strategy == "cluster_swap" and not p.runtime_cluster_swap_enabled:
        yield Finding(f"{GRP}.runtime_rollout_reconfigure_strategy",
                      "cluster_swap exchanges GPUs between the pools, which runtime_cluster_swap_enabled must allow",
                      f"set {GRP}.runtime_cluster_swap_enabled: true, or choose another strategy")


def cluster_swap_needs_training(c: RuleContext) -> Iterator[Finding]:
    p = c.planner
    if p.runtime_cluster_swap_enabled and not p.runtime_reconfigure_training:
        yield Finding(f"{GRP}.runtime_cluster_swap_enabled",
                      "a pool exchange changes the training pool, which runtime_reconfigure_training must allow",
                      f"set {GRP}.runtime_reconfigure_training: true")
    if p.runtime_cluster_swap_enabled and not p.runtime_manage_rollout_processes:
        yield Finding(f"{GRP}.runtime_cluster_swap_enabled",
                      "a pool exchange stops and starts rollout servers, which Libra does not manage here "
                      "(runtime_manage_rollout_processes false)",
                      f"set {GRP}.runtime_manage_rollout_processes: true, or disable cluster swap")


def plan_only_needs_training(c: RuleContext) -> Iterator[Finding]:
    p = c.planner
    if p.runtime_training_pool_plan_only and not p.runtime_reconfigure_training:
        yield Finding(f"{GRP}.runtime_training_pool_plan_only",
                      "records training-pool changes, but runtime_reconfigure_training is false so none are planned",
                      f"set {GRP}.runtime_reconfigure_training: true")


def spare_gpus_for_strategy(c: RuleContext) -> Iterator[Finding]:
    p, cfg = c.planner, c.cfg
    strategy = p.runtime_rollout_reconfigure_strategy
    if not (p.runtime_dynamic_reconfiguration_enabled and c.pinned and strategy in ("blue_green", "prewarm")):
        return
    spare = c.total_gpus - cfg.train_gpus - cfg.rollout_gpus
    if spare < cfg.rollout_tp_size:
        yield Finding(f"{GRP}.runtime_rollout_reconfigure_strategy",
                      f"{strategy} starts new rollout instances on spare GPUs first, but the pinned split leaves "
                      f"{spare} spare GPU(s) (an instance needs rollout_tp_size = {cfg.rollout_tp_size}), so every "
                      f"reconfiguration falls back to diff (event strategy_fallback)",
                      "leave at least one instance's GPUs free, or use diff or cluster_swap")


def strategy_ignored(c: RuleContext) -> Iterator[Finding]:
    # runtime_drain_before_reconfigure is not listed: it also drains a ready rollout instance the reconciler
    # stops outside a reconfiguration (e.g. one adopted beyond the desired count)
    for name in ("runtime_rollout_reconfigure_strategy",):
        if c.is_set(f"{GRP}.{name}") and not c.planner.runtime_dynamic_reconfiguration_enabled:
            yield Finding(f"{GRP}.{name}", "is ignored while runtime_dynamic_reconfiguration_enabled is false",
                          f"remove it or set {MASTER}: true")


def replan_ignored(c: RuleContext) -> Iterator[Finding]:
    for name in ("replan_interval_steps", "replan_min_gain"):
        if c.is_set(f"{GRP}.{name}") and not c.planner.runtime_online_replanning:
            yield Finding(f"{GRP}.{name}", "is ignored while runtime_online_replanning is false",
                          f"remove it or set {GRP}.runtime_online_replanning: true")


def _all_options(cls: type, prefix: str = "") -> Iterator[tuple[str, OptionInfo]]:
    for name, info in options(cls).items():
        yield f"{prefix}{name}", info
        if info.is_section:
            yield from _all_options(info.type, f"{prefix}{name}.")


def deprecated_options(c: RuleContext) -> Iterator[Finding]:
    for path, info in _all_options(Config):
        if info.deprecated and c.is_set(path):
            yield Finding(path, info.deprecated, "remove the option")


def elastic_replica_size(c: RuleContext) -> Iterator[Finding]:
    cfg, size = c.cfg, c.planner.elastic_hybrid_replica_size_gpus
    unit = cfg.train_tp_size * cfg.train_ep_size * cfg.train_pp_size * cfg.train_cp_size
    if size and size % unit:
        yield Finding(f"{GRP}.elastic_hybrid_replica_size_gpus",
                      f"one complete replica is TPxEPxPPxCP = {cfg.train_tp_size}x{cfg.train_ep_size}x"
                      f"{cfg.train_pp_size}x{cfg.train_cp_size} = {unit} ranks, so the size must be a multiple of {unit}",
                      f"set 0 (derive it) or a multiple of {unit}")
    elif size > c.total_gpus:
        yield Finding(f"{GRP}.elastic_hybrid_replica_size_gpus", f"exceeds the cluster ({c.total_gpus} GPUs)",
                      "set 0 (derive it) or a smaller multiple of the replica")


def elastic_min_rollout(c: RuleContext) -> Iterator[Finding]:
    # More than the rollout pool holds is allowed: it keeps every rollout GPU serving (borrowing off), also
    # after re-planning grows the pool. More than the cluster holds is a typo.
    keep = c.planner.elastic_hybrid_min_rollout_gpus
    if keep > c.total_gpus:
        yield Finding(f"{GRP}.elastic_hybrid_min_rollout_gpus", f"exceeds the cluster ({c.total_gpus} GPUs)",
                      f"set at most {c.total_gpus}")


def ehp_expert_parallel(c: RuleContext) -> Iterator[Finding]:
    if c.cfg.train_ep_size > 1 and ehp_switch(c.cfg).mode == "on":
        yield Finding("train_ep_size", "elastic hybrid parallelism (on with runtime_reconfigure_training in a "
                      "synchronous job) cannot "
                      "borrow replicas of an expert-parallel layout: expert gradients reduce over expert-DP groups "
                      "a borrowed world does not mirror",
                      f"set train_ep_size: 1, or keep every rollout GPU serving ({GRP}.elastic_hybrid_min_rollout_gpus: "
                      f"{c.cfg.rollout_gpus}), or {GRP}.runtime_reconfigure_training: false")


def ehp_options_ignored(c: RuleContext) -> Iterator[Finding]:
    switch = ehp_switch(c.cfg)
    if switch.acts:
        return
    for name in ("elastic_hybrid_replica_size_gpus", "elastic_hybrid_min_rollout_gpus"):
        if name in switch.reason:
            continue  # the option that turns borrowing off is not ignored
        if getattr(c.planner, name) != 0:
            yield Finding(f"{GRP}.{name}", f"is ignored: elastic hybrid parallelism is off ({switch.reason})",
                          f"remove it, or run a synchronous job (max_head_offpolicyness: 0) with "
                          f"{GRP}.runtime_reconfigure_training: true")


def decouple_needs_training(c: RuleContext) -> Iterator[Finding]:
    switch = ehp_switch(c.cfg)
    if c.planner.decouple_communication_domains and not switch.acts:
        yield Finding(f"{GRP}.decouple_communication_domains",
                      f"has no effect without borrowed training replicas: elastic hybrid parallelism is off "
                      f"({switch.reason})", f"remove it, or run a synchronous job (max_head_offpolicyness: 0) with "
                      f"{GRP}.runtime_reconfigure_training: true")


def endpoints_required(c: RuleContext) -> Iterator[Finding]:
    if not c.managed_rollout and not c.cfg.rollout_endpoints:
        yield Finding("rollout_endpoints",
                      "Libra does not start rollout servers (runtime_manage_rollout_processes false), so it needs "
                      "the addresses of existing ones", "list them, e.g. rollout_endpoints: [http://10.0.0.5:8100], "
                      f"or set {GRP}.runtime_manage_rollout_processes: true")


def endpoints_unmanaged_only(c: RuleContext) -> Iterator[Finding]:
    if c.managed_rollout and c.cfg.rollout_endpoints:
        yield Finding("rollout_endpoints",
                      "Libra starts its own rollout servers (runtime_manage_rollout_processes true), so endpoints "
                      "would be ignored", f"remove rollout_endpoints, or set {GRP}.runtime_manage_rollout_processes: false")


def endpoint_format(c: RuleContext) -> Iterator[Finding]:
    for i, endpoint in enumerate(c.cfg.rollout_endpoints):
        url = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
        try:
            port = url.port
        except ValueError:
            port = None
        if url.scheme not in ("http", "https") or not url.hostname or port is None:
            yield Finding(f"rollout_endpoints[{i}]", "is not an http(s)://host:port address",
                          "write it as http://HOST:PORT", value=endpoint)
    if len(set(c.cfg.rollout_endpoints)) != len(c.cfg.rollout_endpoints):
        yield Finding("rollout_endpoints", "lists a server more than once", "list each server once")


def replan_needs_a_resizable_pool(c: RuleContext) -> Iterator[Finding]:
    p = c.planner
    if p.runtime_online_replanning and not c.managed_rollout and not p.runtime_reconfigure_training:
        yield Finding(f"{GRP}.runtime_online_replanning", "can change nothing: the rollout servers are external "
                      "(runtime_manage_rollout_processes false) and runtime_reconfigure_training is false",
                      f"set {GRP}.runtime_reconfigure_training: true, or {GRP}.runtime_online_replanning: false")


def replan_interval_within_job(c: RuleContext) -> Iterator[Finding]:
    p = c.planner
    if p.runtime_online_replanning and p.replan_interval_steps > c.cfg.total_steps:
        yield Finding(f"{GRP}.replan_interval_steps", f"is {p.replan_interval_steps}, more than total_steps "
                      f"{c.cfg.total_steps}: no re-planning decision is ever made",
                      f"set it to at most {c.cfg.total_steps}")


def unmanaged_rollout_resize(c: RuleContext) -> Iterator[Finding]:
    if c.planner.runtime_dynamic_reconfiguration_enabled and not c.managed_rollout:
        yield Finding(f"{GRP}.runtime_manage_rollout_processes",
                      "rollout servers are external, so runtime reconfiguration never resizes the rollout pool",
                      "set it to true to let Libra resize the rollout pool")


def sync_mode_nccl(c: RuleContext) -> Iterator[Finding]:
    if c.cfg.rollout_weight_sync_mode == "nccl":
        yield Finding("rollout_weight_sync_mode", "NCCL weight broadcast to rollout engines is not implemented",
                      "use rollout_weight_sync_mode: restart (safetensors publish + reload of all instances)")


def offpolicy_covers_sync(c: RuleContext) -> Iterator[Finding]:
    cfg = c.cfg
    if cfg.max_head_offpolicyness < cfg.sync_interval - 1:
        yield Finding("max_head_offpolicyness",
                      f"with sync_interval {cfg.sync_interval} the rollout policy lags up to {cfg.sync_interval - 1} "
                      f"versions, more than max_head_offpolicyness ({cfg.max_head_offpolicyness}) accepts; every "
                      "sample would be rejected", f"set max_head_offpolicyness >= {cfg.sync_interval - 1}, "
                      "or sync_interval: 1")


def train_backend(c: RuleContext) -> Iterator[Finding]:
    if c.cfg.train_backend != "megatron_core":
        yield Finding("train_backend", "only the megatron_core training backend is implemented",
                      "set train_backend: megatron_core")
