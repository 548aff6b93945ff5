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
from libra.config.mapping import rollout_pool_spec, training_pool_spec
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
    """The rollout pool's spec; `trace` (the controller tracer's settings) turns on the instances' traces.
    The pool keeps its registry and server logs under <run_dir>/rollout."""
    kv_bytes = cfg.rollout_kv_cache_bytes or (0 if cuda_available() else CPU_DEFAULT_KV_CACHE_BYTES)
    return rollout_pool_spec(cfg, num_instances, kv_bytes, run_dir=str(run.root), trace=trace)


def training_spec(
    cfg: Config, run: RunDir, gpus: int, layout: TrainLayout, trace: TraceSettings | None = None
) -> Any:
    """The training pool's spec; `trace` (the controller tracer's settings) turns on the ranks' traces."""
    return training_pool_spec(cfg, gpus, layout, run_dir=str(run.training), trace=trace)


def check_pool_specs(cfg: Config, run: RunDir, desired: Any) -> None:
    """Check both pool specs before anything starts, so a bad setting fails the launch at once (with every
    problem named) instead of failing pool creation tick after tick."""
    from libra.training.hf_arch import read_training_model
    from libra.training.spec import check_spec

    rollout_spec(cfg, run, desired.rollout_instances).validate()
    check_spec(training_spec(cfg, run, desired.train_gpus, desired.train_layout), read_training_model(cfg.model_dir()),
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
