"""The real pool edges of the executor: the rollout pool (`libra.rollout.RolloutPool`, vLLM servers) and the
training pool (`libra.training.TrainingPool`, Megatron-Core workers), built from the job configuration.

Each edge owns its pool object once created, reports members as `MemberView`s, and is the only place that
translates a pool's own notion of state into the transition table's.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from libra.config import Config
from libra.config.mapping import build_from
from libra.controller.members import MemberState
from libra.controller.state import TrainLayout
from libra.controller.tracker import MemberView
from libra.device import cuda_available
from libra.observability.phase_trace import TraceSettings
from libra.run_dir import RunDir

log = logging.getLogger(__name__)
S = MemberState

CPU_DEFAULT_KV_CACHE_BYTES = 64 * 2**20

# RolloutPool instance states -> the transition table
_ROLLOUT_STATES = {
    "pending": S.PENDING,
    "starting": S.STARTING,
    "loading": S.LOADING,
    "reloading": S.LOADING,
    "ready": S.READY,
    "draining": S.DRAINING,
    "stopping": S.DRAINING,
    "stopped": S.STOPPED,
    "failed": S.FAILED,
    "dead": S.FAILED,
}


def rollout_spec(cfg: Config, run: RunDir, num_instances: int, trace: TraceSettings | None = None) -> Any:
    """The rollout pool's spec; `trace` (the controller tracer's settings) turns on the instances' traces."""
    from libra.rollout.spec import RolloutPoolSpec

    kv_bytes = cfg.rollout_kv_cache_bytes or (0 if cuda_available() else CPU_DEFAULT_KV_CACHE_BYTES)
    gpr = cfg.global_resource_planner
    return RolloutPoolSpec(
        model_path=cfg.model_dir(),
        num_instances=num_instances,
        tp_size=cfg.rollout_tp_size,
        max_model_len=cfg.max_model_len,
        kv_cache_bytes=kv_bytes,
        port_base=cfg.rollout_port_base,
        enforce_eager=cfg.rollout_enforce_eager,
        manage_processes=gpr.runtime_manage_rollout_processes,
        endpoints=tuple(cfg.rollout_endpoints),
        reload_method=cfg.rollout_weight_reload_method,
        reload_strategy=cfg.rollout_weight_reload_strategy,
        max_concurrent_requests=cfg.effective_max_concurrent_rollouts,
        run_dir=str(run.root),  # the pool keeps its registry and server logs under <run_dir>/rollout
        seed=cfg.seed,
        gpu_memory_utilization=cfg.rollout_gpu_memory_utilization,
        trace=trace,
    )


def training_spec(
    cfg: Config, run: RunDir, gpus: int, layout: TrainLayout, trace: TraceSettings | None = None
) -> Any:
    """The training pool's spec; `trace` (the controller tracer's settings) turns on the ranks' traces."""
    from libra.algo.spec import AlgorithmSpec, ISCorrectionSpec, RefKLSpec
    from libra.training.spec import CheckpointRetention, MegatronOptions, OptimizerSpec, TrainingPoolSpec

    a, o = cfg.algorithm, cfg.optimizer
    return TrainingPoolSpec(
        model_path=cfg.model_dir(),
        num_gpus=gpus,
        tp=layout.tp,
        pp=layout.pp,
        cp=layout.cp,
        ep=layout.ep,
        vpp=layout.vpp,
        micro_batch_size=cfg.train_micro_batch_size,
        recompute_logprobs=cfg.recompute_logprobs,
        recompute_micro_batch_size=cfg.recompute_micro_batch_size,
        algorithm=build_from(
            AlgorithmSpec, a,
            ref_kl=build_from(RefKLSpec, a.ref_kl),
            is_correction=build_from(ISCorrectionSpec, a.is_correction),
        ),
        optimizer=build_from(OptimizerSpec, o),
        megatron=build_from(MegatronOptions, cfg, prefix="megatron_"),
        seed=cfg.seed,
        run_dir=str(run.training),
        params_dtype=cfg.megatron_params_dtype,
        retention=CheckpointRetention(keep_last=max(1, cfg.checkpoint.keep_last), keep_every=cfg.checkpoint.keep_every),
        trace=trace,
    )


def check_pool_specs(cfg: Config, run: RunDir, desired: Any) -> None:
    """Check both pool specs before anything starts, so a bad setting fails the launch at once (with every
    problem named) instead of failing pool creation tick after tick."""
    from libra.training.hf_arch import read_hf_arch
    from libra.training.spec import check_spec

    rollout_spec(cfg, run, desired.rollout_instances).validate()
    check_spec(training_spec(cfg, run, desired.train_gpus, desired.train_layout), read_hf_arch(cfg.model_dir()),
               cuda_available())


class _PoolEdge:
    """What both pool edges hold: the job's configuration, run directory, Ray runtime, trace settings and,
    once created, the pool."""

    def __init__(self, cfg: Config, run: RunDir, runtime: Any, trace: TraceSettings | None = None) -> None:
        self.cfg = cfg
        self.run = run
        self.runtime = runtime
        self.trace = trace
        self.pool: Any = None


class RolloutPoolEdge(_PoolEdge):
    """Creates the `RolloutPool` on first use; afterwards adds, removes and reports its instances."""

    def __init__(self, cfg: Config, run: RunDir, runtime: Any, trace: TraceSettings | None = None) -> None:
        super().__init__(cfg, run, runtime, trace)
        self._lock = threading.Lock()

    def create(self, num_instances: int) -> list[MemberView]:
        from libra.rollout.pool import RolloutPool

        pool = RolloutPool(self.runtime, rollout_spec(self.cfg, self.run, num_instances, self.trace))
        try:
            pool.start()
        except BaseException:
            try:
                pool.shutdown()
            except Exception:
                log.debug("shutdown after a failed start", exc_info=True)
            raise
        self.pool = pool
        return self.views()

    def add(self) -> MemberView:
        # One membership change at a time: the pool names a new instance from the ones it already knows,
        # so two concurrent adds could pick the same name.
        with self._lock:
            instance_id = self._pool().add_instance()
        for view in self.views():
            if view.key == instance_id:
                return view
        return MemberView(str(instance_id), S.READY)

    def remove(self, key: str, drain: bool) -> None:
        with self._lock:
            self._pool().remove_instance(key, drain=drain)

    def views(self) -> list[MemberView]:
        pool = self.pool
        if pool is None:
            return []
        return [instance_view(info) for info in pool.instances()]

    def _pool(self) -> Any:
        if self.pool is None:
            raise RuntimeError("the rollout pool has not been created")
        return self.pool


def instance_view(info: Any) -> MemberView:
    """A `RolloutPool` `InstanceInfo` as a member view (unhealthy = FAILED whatever its state says)."""
    state_name = str(getattr(info, "state", "ready")).lower()
    state = _ROLLOUT_STATES.get(state_name, S.READY)
    healthy = bool(getattr(info, "healthy", True))
    error = ""
    if not healthy and state in (S.READY, S.LOADING):
        state, error = S.FAILED, f"instance reported unhealthy (state {state_name})"
    details = {}
    for name in ("host", "port", "pid", "gpu_ids", "weight_version", "adopted"):
        if hasattr(info, name):
            value = getattr(info, name)
            details[name] = list(value) if isinstance(value, tuple | list) else value
    return MemberView(key=str(getattr(info, "instance_id", getattr(info, "id", ""))), state=state, info=details,
                      error=error)


class TrainingPoolEdge(_PoolEdge):
    """Creates the `TrainingPool` (actors, process groups, HF -> Megatron load); reports one member per rank."""

    def __init__(self, cfg: Config, run: RunDir, runtime: Any, trace: TraceSettings | None = None) -> None:
        super().__init__(cfg, run, runtime, trace)
        self.gpus = 0
        self.layout = TrainLayout()

    def create(self, gpus: int, layout: TrainLayout) -> list[MemberView]:
        from libra.training.pool import TrainingPool

        pool = TrainingPool(self.runtime, training_spec(self.cfg, self.run, gpus, layout, self.trace))
        try:
            pool.start()
        except BaseException:
            try:
                pool.shutdown()
            except Exception:
                log.debug("shutdown after a failed start", exc_info=True)
            raise
        self.pool, self.gpus, self.layout = pool, gpus, layout
        return self.views()

    def views(self) -> list[MemberView]:
        if self.pool is None:
            return []
        return [MemberView(key=f"rank-{rank}", state=S.READY, info={"rank": rank}) for rank in range(self.gpus)]
