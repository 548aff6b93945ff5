"""The real pool edges of the executor: the rollout pool (`libra.rollout.RolloutPool`, vLLM servers) and the
training pool (`libra.training.TrainingPool`, Megatron-Core workers), built from the job configuration.

Each edge owns its pool object once created, reports members as `MemberView`s, and is the only place that
translates a pool's own notion of state into the transition table's. The rollout edge is the actuator the
reconciler drives: instance ids are member ids, and a publish reports the ACKed version of each instance.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from libra.config import Config
from libra.config.mapping import rollout_pool_spec, training_pool_spec
from libra.controller.executor import PublishOutcome
from libra.controller.gate import WeightsRef
from libra.controller.members import MemberState
from libra.controller.state import RolloutSpec, TrainLayout
from libra.controller.tracker import MemberView
from libra.controller.train_plan import layout_fingerprint
from libra.device import pools_on_cuda
from libra.error_chain import causes
from libra.observability.phase_trace import TraceSettings, get_tracer, now_ns
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
    kv_bytes = cfg.rollout_kv_cache_bytes or (0 if pools_on_cuda() else CPU_DEFAULT_KV_CACHE_BYTES)
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
               pools_on_cuda())


def training_target_problems(cfg: Config, run: RunDir) -> Callable[[int, TrainLayout], list[str]]:
    """What refuses a training pool of (GPUs, layout) beyond the planner's layout rules: the training spec's
    checks (settings this platform cannot run) and, when `memory_budget_check_enabled`, the planner's memory
    model (peak bytes of the worst rank against the GPU's memory less the safety margin)."""

    def problems(gpus: int, layout: TrainLayout) -> list[str]:
        from libra.planning import planner_inputs
        from libra.training.hf_arch import read_training_model
        from libra.training.spec import InvalidTrainingSpecError, NotValidatedOnCPUError, check_spec
        from planner.memory import train_memory

        try:
            check_spec(training_spec(cfg, run, gpus, layout), read_training_model(cfg.model_dir()), pools_on_cuda())
        except (InvalidTrainingSpecError, NotValidatedOnCPUError) as exc:
            return [line.strip().removeprefix("- ") for line in str(exc).splitlines()[1:] if line.strip()]
        inputs = planner_inputs(cfg)
        if inputs.budget.check_enabled:
            estimate = train_memory(inputs, layout, layout.dp(gpus))
            if not estimate.fits:
                return [f"the planner's memory model puts {estimate.where} at {estimate.peak_bytes / 2**30:.2f} GiB, "
                        f"over the {estimate.capacity_bytes / 2**30:.2f} GiB of a GPU (memory_budget_check_enabled)"]
        return []

    return problems


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

    def __init__(self, cfg: Config, run: RunDir, runtime: Any, trace: TraceSettings | None = None) -> None:
        super().__init__(cfg, run, runtime, trace)
        self._stop_watchers: list[Callable[[str], None]] = []

    def create(self, member_ids: Sequence[str], spec: RolloutSpec) -> list[MemberView]:
        """Open the pool, adopt the live servers an earlier controller left (those whose launch settings
        still hold; the others are stopped), start the missing `member_ids` and serve every instance on the
        pool's current weights. Surplus adopted servers are reported and trimmed by the reconciler.

        Every change of the rollout pool is a `reconfigure.*` span of the controller's phase trace (start,
        drain or stop of an instance, swap of the serving set), from which `libra trace timeline` draws it."""
        started = now_ns()
        views = self._create(member_ids, spec)
        ended = now_ns()
        for view in views:
            if view.key in member_ids and view.state is not S.FAILED:
                get_tracer().record("reconfigure.start", started, ended, member_id=view.key, tp=spec.tp)
        get_tracer().record("reconfigure.swap", ended, ended,
                            serving=[v.key for v in views if v.serving is not False and v.state is not S.FAILED])
        return views

    def _create(self, member_ids: Sequence[str], spec: RolloutSpec) -> list[MemberView]:
        from libra.rollout.pool import RolloutPool

        pool = RolloutPool(self.runtime, rollout_spec(self.cfg, self.run, len(member_ids), self.trace))
        failures: dict[str, Exception] = {}
        try:
            if not pool.spec.manage_processes:
                pool.start()  # configured endpoints: they all serve
            else:
                pool.open()
                adopted = self._adopt_live(pool)
                missing = [m for m in member_ids if m not in adopted][: max(0, len(member_ids) - len(adopted))]
                failures = self._start_all(pool, missing, spec)
                if failures and not pool.instances():
                    raise next(iter(failures.values()))
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
        # One failed start does not discard the instances that run (an adopted one above all): its member
        # is reported failed and the reconciler replaces it like any other failed member.
        failed = [MemberView(key=m, state=S.FAILED, error=f"start failed: {type(e).__name__}: {e}")
                  for m, e in failures.items()]
        return self.views() + failed

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
    def _start_all(pool: Any, member_ids: Sequence[str], spec: RolloutSpec) -> dict[str, Exception]:
        """Start `member_ids` in parallel; the starts that failed, by member id (each already cleaned up)."""
        if not member_ids:
            return {}
        launch = pool.spec.instance_spec(spec.tp)
        failures: dict[str, Exception] = {}
        with ThreadPoolExecutor(max_workers=len(member_ids), thread_name_prefix="libra-rollout-start") as threads:
            futures = {m: threads.submit(pool.start_instance, m, launch) for m in member_ids}
            for member_id, future in futures.items():
                try:
                    future.result()
                except Exception as exc:
                    log.warning("rollout instance %s did not start: %s", member_id, exc)
                    failures[member_id] = exc
        return failures

    def start(self, member_id: str, spec: RolloutSpec) -> MemberView:
        pool = self._pool()
        launch = pool.spec.instance_spec(spec.tp)
        if spec.fingerprint and launch.fingerprint() != spec.fingerprint:
            raise ValueError(f"instance {member_id}: the desired launch fingerprint {spec.fingerprint} is not this "
                             f"pool's ({launch.fingerprint()}); the configuration changed under a running job")
        with get_tracer().span("reconfigure.start", member_id=member_id, tp=spec.tp):
            return instance_view(pool.start_instance(member_id, launch))

    def stop(self, key: str, drain: bool) -> None:
        for stopping in self._stop_watchers:  # borrowed training ranks parked on its GPUs stop first
            stopping(key)
        with get_tracer().span("reconfigure.drain" if drain else "reconfigure.stop", member_id=key):
            self._pool().stop_instance(key, drain=drain)

    def publish(self, weights: WeightsRef, keys: Sequence[str] | None) -> PublishOutcome:
        pool = self._pool()
        targets = None if keys is None else list(keys)
        # An instance whose server failed does not fail the job's publish: it is left out and replaced.
        report = pool.publish_weights(weights.version, weights.path, weights.checksum, instance_ids=targets,
                                      leave_out_failed=True)
        acks = {str(a.instance_id): int(a.weight_version) for a in getattr(report, "acks", ())
                if hasattr(a, "instance_id") and hasattr(a, "weight_version")}
        return PublishOutcome(acks, {"report": report}, left_out=dict(getattr(report, "left_out", ())))

    def set_serving(self, keys: Sequence[str]) -> None:
        with get_tracer().span("reconfigure.swap", serving=list(keys)):
            self._pool().set_serving(list(keys))

    def views(self) -> list[MemberView]:
        pool = self.pool
        if pool is None:
            return []
        return [instance_view(info) for info in pool.instances()]

    # ---- lending GPUs to the training step (elastic hybrid parallelism, `libra.controller.ehp_borrow`) ----
    def lend(self, keys: Sequence[str], sleep: bool) -> list[Any]:
        """Take the instances `keys` out of serving (drained, asleep when `sleep`); their `LendReport`s."""
        return list(self._pool().lend_instances(list(keys), sleep))

    def give_back(self, keys: Sequence[str]) -> list[Any]:
        """Wake the lent instances `keys`, bring them to the current weights and serve them; `ReturnReport`s."""
        return list(self._pool().return_instances(list(keys)))

    def lent_gpus(self, key: str) -> list[Any]:
        """The `LentGpu`s through which borrowed training ranks join instance `key`'s GPUs."""
        return list(self._pool().lendable_gpus(key))

    def watch_stops(self, stopping: Callable[[str], None]) -> None:
        """Call `stopping(key)` before an instance is stopped (parked borrowed ranks on its GPUs go first)."""
        self._stop_watchers.append(stopping)

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
    failure = str(getattr(info, "failure", "") or "")  # why the pool failed it (silent to /health, host gone)
    if state == S.FAILED and failure:
        error = failure
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


def training_worker_loss(exc: BaseException) -> str:
    """How `exc` (or an error it was raised from) says that a training rank was lost: "died" (its process
    ended), "hung" (a collective call outlived its deadline), or "" when it says neither."""
    from libra.cluster.training_workers import WorkerHungError, WorkerLostError

    for seen in causes(exc):
        if isinstance(seen, WorkerHungError):
            return "hung"
        if isinstance(seen, WorkerLostError):
            return "died"
    return ""


def rollout_fingerprint(cfg: Config, run: RunDir, tp: int) -> str:
    """The launch fingerprint of one rollout instance of TP `tp` under this configuration."""
    return str(rollout_spec(cfg, run, 1).instance_spec(tp).fingerprint())


class TrainingPoolEdge(_PoolEdge):
    """Creates the `TrainingPool` (actors, process groups, HF -> Megatron load) and resizes it at a step
    boundary (`resize`); reports one member per rank, keyed by rank and resize epoch, with the layout it runs
    as the member's fingerprint."""

    def __init__(self, cfg: Config, run: RunDir, runtime: Any, trace: TraceSettings | None = None) -> None:
        super().__init__(cfg, run, runtime, trace)
        self.gpus = 0
        self.layout = TrainLayout()
        self.epoch = 0  # resizes so far: a resize replaces every rank, so its members get new keys
        self._ehp: Any = None  # the EhpSession of the current pool (`ehp_session`)

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

    @property
    def resize_root(self) -> str:
        """Where resize checkpoints go (beside the job's own checkpoints, with the same retention)."""
        return str(self.run.training / "resize")

    def resize(self, gpus: int, layout: TrainLayout,
               on_measured: Callable[[dict[str, Any]], None] | None = None) -> tuple[list[MemberView], dict[str, Any]]:
        """Move the running pool to `gpus` GPUs under `layout` (`TrainingPool.relayout`: it waits for a step
        in progress). A resize that fails after its checkpoint was written is retried once at once from that
        checkpoint, so the RL loop does not find the pool down; the phases go into the controller's trace."""
        pool = self._pool()
        self.stop_borrowed("the training pool is resized")
        phases: list[tuple[str, int]] = []

        def measured(cost: Any) -> None:
            if on_measured is not None:
                on_measured(cost.to_dict())

        pool.on_resize_measured = measured
        try:
            cost = pool.relayout(gpus, layout, self.resize_root, on_phase=lambda p: phases.append((p, now_ns())))
        except Exception as exc:  # libra.training.resize.TrainingResizeError names the phase that failed
            if getattr(exc, "phase", "save") in ("save", "resume"):
                raise
            log.warning("training resize failed (%s); resuming from its checkpoint", exc)
            phases.clear()
            cost = pool.relayout(gpus, layout, self.resize_root, on_phase=lambda p: phases.append((p, now_ns())))
        _trace_phases(phases, now_ns(), cost.step, gpus)
        self.gpus, self.layout = gpus, layout
        self.epoch += 1
        return self.views(), cost.to_dict()

    def restart(self, gpus: int | None = None,
                layout: TrainLayout | None = None) -> tuple[list[MemberView], dict[str, Any]]:
        """Replace every rank after one was lost, at the same GPU count and layout or at `gpus` GPUs under
        `layout` (`TrainingPool.replace_workers`); the new ranks hold the initial weights until the RL loop
        loads a checkpoint."""
        self.stop_borrowed("a training worker was lost")
        pool = self._pool()
        try:
            cost = pool.replace_workers(gpus, layout)
        finally:  # a failed start leaves the pool down at its new spec
            self.gpus, self.layout = pool.spec.num_gpus, pool.layout
            self.epoch += 1
        return self.views(), cost.to_dict()

    def _pool(self) -> Any:
        if self.pool is None:
            raise RuntimeError("the training pool has not been created")
        return self.pool

    def ehp_session(self) -> Any:
        """The `EhpSession` (`libra.training.ehp`) of the running pool with the job's elastic hybrid parallelism
        settings: it plans, attaches, parks and detaches borrowed replicas and runs their shared step. One per
        pool object, so that replicas parked after a step are there for the next one."""
        from libra.training.ehp import EhpSession, EhpSettings

        pool = self._pool()
        if self._ehp is None or self._ehp.pool is not pool:
            self.stop_borrowed("the training pool was replaced")
            self._ehp = EhpSession(pool, EhpSettings.from_planner_options(self.cfg.global_resource_planner))
        return self._ehp

    def stop_borrowed(self, reason: str) -> None:
        """Stop borrowed replicas parked between steps (a resize, the job's end)."""
        if self._ehp is not None:
            self._ehp.release(reason)

    def views(self) -> list[MemberView]:
        if self.pool is None or not self.pool.running:  # down after a failed resize: no rank runs
            return []
        suffix = f"@{self.epoch}" if self.epoch else ""
        return [MemberView(key=f"rank-{rank}{suffix}", state=S.READY, info={"rank": rank},
                           fingerprint=layout_fingerprint(self.layout)) for rank in range(self.gpus)]


_PHASE_TRACE_NAMES = {"save": "checkpoint.save", "stop": "reconfigure.stop", "start": "reconfigure.start",
                      "load": "checkpoint.load", "resume": "checkpoint.load"}


def _trace_phases(phases: list[tuple[str, int]], end_ns: int, step: int, gpus: int) -> None:
    """The phases of a training resize as spans of the controller's trace (pool `train`)."""
    tracer = get_tracer()
    bounds = [*phases[1:], ("", end_ns)]
    for (phase, start), (_, stop) in zip(phases, bounds, strict=True):
        tracer.record(_PHASE_TRACE_NAMES.get(phase, "reconfigure.swap"), start, stop, step=step, pool="train",
                      phase=f"train_resize.{phase}", gpus=gpus)
