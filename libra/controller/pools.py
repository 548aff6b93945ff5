"""The real pool edges of the executor: the rollout pool (`libra.rollout.RolloutPool`, vLLM servers) and the
training pool (`libra.training.TrainingPool`, Megatron-Core workers), built from the job configuration.

Each edge owns its pool object once created, reports members as `MemberView`s, and is the only place that
translates a pool's own notion of state into the transition table's. The rollout edge is the actuator the
reconciler drives: instance ids are member ids, and a publish reports the ACKed version of each instance.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from libra.config import Config
from libra.config.mapping import rollout_pool_spec, training_pool_spec
from libra.controller.executor import PublishOutcome
from libra.controller.gate import WeightsRef
from libra.controller.members import MemberState
from libra.controller.state import RolloutSpec, TrainLayout
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
    """The rollout pool as an actuator: the reconciler names every instance (its member id), the pool starts,
    adopts, stops, reloads and routes exactly what it is told."""

    def create(self, member_ids: Sequence[str], spec: RolloutSpec) -> list[MemberView]:
        """Open the pool, adopt the live servers an earlier controller left (those whose launch settings
        still hold; the others are stopped), start the missing `member_ids` and serve every instance on the
        pool's current weights. Surplus adopted servers are reported and trimmed by the reconciler."""
        from libra.rollout.pool import RolloutPool

        pool = RolloutPool(self.runtime, rollout_spec(self.cfg, self.run, len(member_ids), self.trace))
        try:
            if not pool.spec.manage_processes:
                pool.start()  # configured endpoints: they all serve
            else:
                pool.open()
                adopted = self._adopt_live(pool)
                missing = [m for m in member_ids if m not in adopted][: max(0, len(member_ids) - len(adopted))]
                self._start_all(pool, missing, spec)
                current = [i.id for i in pool.instances() if i.weight_version == pool.weight_version]
                if current:
                    pool.set_serving(current)
        except BaseException:
            try:
                pool.shutdown()
            except Exception:
                log.debug("shutdown after a failed start", exc_info=True)
            raise
        self.pool = pool
        return self.views()

    @staticmethod
    def _adopt_live(pool: Any) -> list[str]:
        adopted = []
        for server in sorted(pool.live_servers(), key=lambda s: s.instance_id):
            if server.in_pool:
                continue
            launch = pool.spec.instance_spec(server.tp_size)
            if launch.fingerprint() == server.fingerprint:
                pool.start_instance(server.instance_id, launch)
                adopted.append(server.instance_id)
            else:
                log.info("stopping live server %s: its launch settings differ from this job's", server.instance_id)
                pool.stop_instance(server.instance_id, drain=False)
        return adopted

    @staticmethod
    def _start_all(pool: Any, member_ids: Sequence[str], spec: RolloutSpec) -> None:
        if not member_ids:
            return
        launch = pool.spec.instance_spec(spec.tp)
        with ThreadPoolExecutor(max_workers=len(member_ids), thread_name_prefix="libra-rollout-start") as threads:
            for future in [threads.submit(pool.start_instance, m, launch) for m in member_ids]:
                future.result()

    def start(self, member_id: str, spec: RolloutSpec) -> MemberView:
        pool = self._pool()
        launch = pool.spec.instance_spec(spec.tp)
        if spec.fingerprint and launch.fingerprint() != spec.fingerprint:
            raise ValueError(f"instance {member_id}: the desired launch fingerprint {spec.fingerprint} is not this "
                             f"pool's ({launch.fingerprint()}); the configuration changed under a running job")
        return instance_view(pool.start_instance(member_id, launch))

    def stop(self, key: str, drain: bool) -> None:
        self._pool().stop_instance(key, drain=drain)

    def publish(self, weights: WeightsRef, keys: Sequence[str] | None) -> PublishOutcome:
        pool = self._pool()
        targets = None if keys is None else list(keys)
        report = pool.publish_weights(weights.version, weights.path, weights.checksum, instance_ids=targets)
        acks = {str(a.instance_id): int(a.weight_version) for a in getattr(report, "acks", ())
                if hasattr(a, "instance_id") and hasattr(a, "weight_version")}
        return PublishOutcome(acks, {"report": report})

    def set_serving(self, keys: Sequence[str]) -> None:
        self._pool().set_serving(list(keys))

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
    for name in ("host", "port", "pid", "gpu_ids", "weight_version", "adopted", "outstanding"):
        if hasattr(info, name):
            value = getattr(info, name)
            details[name] = list(value) if isinstance(value, tuple | list) else value
    serving = getattr(info, "serving", None)
    version = getattr(info, "weight_version", None)
    return MemberView(
        key=str(getattr(info, "instance_id", getattr(info, "id", ""))),
        state=state,
        info=details,
        error=error,
        tp=int(getattr(info, "tp_size", 0) or 0),
        gpu_ids=tuple(str(g) for g in getattr(info, "gpu_ids", ()) or ()),
        fingerprint=str(getattr(info, "fingerprint", "") or ""),
        serving=serving if isinstance(serving, bool) else None,
        weight_version=version if isinstance(version, int) else None,
    )


def rollout_fingerprint(cfg: Config, run: RunDir, tp: int) -> str:
    """The launch fingerprint of one rollout instance of TP `tp` under this configuration."""
    return str(rollout_spec(cfg, run, 1).instance_spec(tp).fingerprint())


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
