"""The long-running controller of one job.

It prepares the run directory, decides the initial allocation (planner or pinned split), starts or joins
Ray, and hands the pools to the reconciler: the control loop creates them from the desired state and keeps
them there (replacing failed members, adopting servers left by an earlier controller). The RL loop then
runs on the main thread: a lag-bounded batch from the rollout producer -> advantages -> one training step
-> weight publish every `sync_interval` steps -> validated ACKs -> metrics, evaluation, checkpoints.

The rollout pool can be reconfigured while the job runs (`request_reconfigure`: a new instance count and/or
TP, carried out by a strategy of `libra.controller.strategies`); weight publishes of the RL loop go through
the executor and its weight gate, so they never interleave with a change of who serves.

A stop request (SIGINT / SIGTERM, or `--max-steps`) ends the loop at a step boundary; the `finally` path
always stops the producer, saves a checkpoint, stops the pools, flushes traces and stops the Ray cluster
it started. A launch on an existing run directory resumes from its newest complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import yaml

from libra.cluster.node_fence import FencedNode
from libra.config import Config, dump
from libra.config.elastic_hybrid import ehp_switch
from libra.controller import bootstrap
from libra.controller.allocation import initial_allocation
from libra.controller.batching import CollectionCancelled
from libra.controller.control_loop import ControlLoop
from libra.controller.desired_store import DesiredStore
from libra.controller.ehp_borrow import EhpBorrower
from libra.controller.events import EventLog, started_generations
from libra.controller.executor import Executor, PublishOutcome
from libra.controller.gate import WeightGate, WeightsRef
from libra.controller.members import MemberState, StateTimeouts
from libra.controller.node_loss import MAX_FENCE_ROUNDS, NodeLossRecovery
from libra.controller.pools import (
    RolloutPoolEdge,
    TrainingPoolEdge,
    check_pool_specs,
    rollout_fingerprint,
    rollout_spec,
    training_target_problems,
    training_worker_loss,
)
from libra.controller.reconfigure import (
    ReconfigureLimits,
    ReconfigureTarget,
    finish_if_converged,
    plan_reconfigure,
    trigger_switch,
)
from libra.controller.replanner import Replanner, build_replanner
from libra.controller.reporting import Reporter
from libra.controller.rl_loop import RLLoop
from libra.controller.services import GenerationService, JobSession, TrainingService
from libra.controller.signals import StopRequest
from libra.controller.state import ROLLOUT, TRAIN, DesiredState, ObservedState
from libra.controller.step_gate import StepGate
from libra.controller.tracker import MemberTracker
from libra.controller.train_actions import record_plan_only
from libra.device import declare_pools_device
from libra.observability.console import make_console
from libra.observability.metrics import LibraMetrics
from libra.observability.phase_trace import ENV_DIR, ENV_ENABLE, PhaseTracer, get_tracer, now_ns, set_tracer
from libra.run_dir import RunDir, write_json_atomic

log = logging.getLogger(__name__)


def node_reaches_peers_again(node: FencedNode) -> bool:
    """Whether a node left out (a fenced training node, a held-back lending node) reaches the peers it could
    not (Ray probes on the nodes, `fence_probe`)."""
    from libra.cluster.fence_probe import reaches_again

    return reaches_again(node)


class TrainingNodesUnreachable(RuntimeError):
    """The training pool's first start found nodes of its ranks that cannot reach each other."""


class StopRequested(Exception):
    pass


@dataclass(frozen=True)
class LaunchOptions:
    max_steps: int = 0  # stop once this global step is reached (0 = total_steps)
    console: str = ""  # override tracking.console
    keep_servers: bool = False  # leave rollout servers running at exit (for adoption by the next launch)
    startup_timeout_s: float = 1800.0
    tick_interval_s: float = 1.0
    curve_interval_s: float = 120.0
    install_signal_handlers: bool = True
    debug: bool = False  # tracebacks of logged errors on stderr too (always in controller.log)
    timeouts: StateTimeouts = field(default_factory=StateTimeouts)


@dataclass
class RunResult:
    outcome: str  # finished | interrupted | failed
    start_step: int
    step: int
    error: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    stop_reason: str = ""  # what asked the job to stop: SIGINT, SIGTERM, ... ("" = nothing did)


class Controller:
    """One job from launch to exit; `run_job()` never leaves a server, worker or Ray cluster it started."""

    def __init__(self, cfg: Config, run: RunDir, options: LaunchOptions | None = None) -> None:
        self.cfg = cfg
        self.run = run
        self.options = options or LaunchOptions()
        self.stop = StopRequest()
        self.events = EventLog(None)
        self.end_step = min(cfg.total_steps, self.options.max_steps or cfg.total_steps)
        self.rl: RLLoop | None = None
        self.runtime: Any = None
        self.node_loss: NodeLossRecovery | None = None
        self.store: DesiredStore | None = None
        self.tracker: MemberTracker | None = None
        self.executor: Executor | None = None
        self.loop: ControlLoop | None = None
        self.rollout_edge: RolloutPoolEdge | None = None
        self.train_edge: TrainingPoolEdge | None = None
        self.metrics: LibraMetrics | None = None
        self.reporter: Reporter | None = None
        self.gate = WeightGate()
        self.step_gate = StepGate()  # operator pause / resume / drain at step boundaries
        self.api: Any = None  # the operator API server (libra.api.server)
        self.replanner: Replanner | None = None  # runtime_online_replanning
        self.borrower: EhpBorrower | None = None  # elastic hybrid parallelism, where it acts
        self.task: Any = None
        self.tokenizer: Any = None
        self._tracer: PhaseTracer | None = None
        self._log_handlers: list[logging.Handler] = []
        self._saved_env: dict[str, str | None] = {}
        self._restore_pools_device: Callable[[], object] = lambda: None

    # ---- entry point ----------------------------------------------------------------------------------
    def run_job(self) -> RunResult:
        outcome, error = "failed", ""
        if self.options.install_signal_handlers:
            self.stop.install()
        try:
            self._prepare()
            self._start_operator_api()
            self._bootstrap()
            self._start_pools()
            self._memory_dry_run()
            self.replanner = build_replanner(self.cfg, self.desired_state, self.request_reconfigure, self.events)
            assert self.reporter is not None
            self.rl = RLLoop(self.cfg, self.run, self.session(), self.events, self.reporter, self.task,
                             self.tokenizer, self.stop, self.end_step, gate=self.step_gate)
            self.rl.restore()
            self.rl.run_steps()
            outcome = "interrupted" if self.stop.requested and self.step < self.end_step else "finished"
            if outcome == "finished" and self.step_gate.drain_requested and self.step < self.end_step:
                outcome = "drained"
        except (StopRequested, CollectionCancelled, KeyboardInterrupt):
            outcome = "interrupted"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.events.emit("error", error)
            log.exception("the job failed")
            raise
        finally:
            self._shutdown(outcome, error)
            self.stop.restore()
        rl = self.rl
        return RunResult(outcome, rl.start_step if rl else 0, self.step, error, dict(rl.timings) if rl else {},
                         rl.rows if rl else [], stop_reason=self.stop.reason)

    @property
    def step(self) -> int:
        return self.rl.state.step if self.rl is not None else 0

    # ---- setup ----------------------------------------------------------------------------------------
    def _prepare(self) -> None:
        run, cfg = self.run, self.cfg
        resuming = run.is_existing_run()
        run.create()
        self._log_handlers = bootstrap.setup_logging(run, cfg.log_level, debug=self.options.debug)
        self.events = EventLog(run.events_jsonl)
        with open(run.config_yaml, "w", encoding="utf-8") as fh:
            yaml.safe_dump(dump(cfg), fh, sort_keys=False)
        for warning in cfg.warnings:
            self.events.emit("config_warning", warning)
        if cfg.phase_trace_enabled:
            # Every process the job starts (Ray workers, rollout servers) inherits these and traces into the run
            self._saved_env = {name: os.environ.get(name) for name in (ENV_ENABLE, ENV_DIR)}
            os.environ[ENV_ENABLE] = "1"
            os.environ.setdefault(ENV_DIR, str(run.traces))
        self._tracer = PhaseTracer.open(run.root, role="controller", rank=0, enabled=cfg.phase_trace_enabled)
        set_tracer(self._tracer)
        if "prometheus" in cfg.tracking.backends:  # a port without the backend serves nothing (tracking.port_unused)
            self.metrics = LibraMetrics()
            self.events.subscribe(self.metrics.record_event)  # actions, reconfigurations, operator calls
            if cfg.tracking.prometheus_port > 0:
                host = cfg.tracking.prometheus_bind_address
                port = self.metrics.serve(cfg.tracking.prometheus_port, host)
                self.events.emit("prometheus", f"metrics on http://{host}:{port}/metrics", port=port)
        console = make_console(self.options.console or cfg.tracking.console)
        self.reporter = Reporter(run, cfg.name or "libra", self.end_step, console, self.events, self.metrics,
                                 write_jsonl="jsonl" in cfg.tracking.backends,
                                 curve_interval_s=self.options.curve_interval_s)
        self.reporter.start(0, "starting")
        self.events.emit("launch", "resuming an existing run" if resuming else "new run", run_dir=str(run.root),
                         end_step=self.end_step, resuming=resuming)

    def _bootstrap(self) -> None:
        cfg, run = self.cfg, self.run
        assert self.reporter is not None
        # the pools' checks and defaults follow the cluster the configuration describes, not this node
        previous = declare_pools_device(cfg.cluster.logical_gpus)
        self._restore_pools_device = lambda: declare_pools_device(previous)
        if cfg.build_tiny_model.enabled:
            self.reporter.set_state("starting", message="building the tiny model")
            bootstrap.ensure_tiny_model(cfg)
        # the task reads its files before anything starts: a bad dataset stops the job before Ray does
        self.tokenizer = bootstrap.load_tokenizer(cfg)
        self.task = bootstrap.load_task(cfg, self.tokenizer)
        desired = DesiredState.load(run.desired_state_json) if run.is_existing_run() else None
        if desired is None:
            self.reporter.set_state("starting", message="planning the initial allocation")
            allocation = initial_allocation(cfg)
            write_json_atomic(run.plan_json, allocation.plan)
            desired = allocation.desired_state(cfg)
            self.events.emit("allocation", desired.reason, train_gpus=desired.train_gpus,
                             rollout_gpus=desired.rollout_gpus, layout=desired.train_layout.describe(desired.train_gpus))
        else:
            self.events.emit("desired_restored", "desired state restored from the run directory",
                             generation=desired.generation)
        gpr = cfg.global_resource_planner
        # what the running configuration says about the cluster and the instances' launch settings
        desired = dataclasses.replace(
            desired, rollout_fingerprint=rollout_fingerprint(cfg, run, desired.rollout_tp),
            cluster_gpus=cfg.total_gpus, cluster_swap_enabled=gpr.runtime_cluster_swap_enabled,
        )
        self.store = DesiredStore(run.desired_state_json, desired)
        if desired.reconfiguring:
            self.events.emit("reconfigure_resumed", f"continuing {desired.reconfiguring}",
                             generation=desired.generation)
        check_pool_specs(cfg, run, desired)
        self.reporter.set_state("starting", message="starting Ray")
        self.runtime = bootstrap.start_ray(cfg, namespace=f"libra-{cfg.name or 'job'}")
        self.stop.reinstall()  # ray.init replaced the SIGTERM handler with one that aborts the process
        self.events.emit("ray", "joined Ray" if not self.runtime.owned else "started a local Ray",
                         address=self.runtime.address)

    @property
    def desired(self) -> DesiredState | None:
        return self.store.get() if self.store is not None else None

    def _start_pools(self) -> None:
        cfg, run = self.cfg, self.run
        assert self.reporter is not None and self.desired is not None
        self.tracker = MemberTracker(self.events, started_for=started_generations(run.events_jsonl, ROLLOUT),
                                     early_failure_backoff_s=cfg.restart_backoff_s)
        # the pools' processes trace into the controller's directory (ranks 1000+ and 2000+)
        trace = self._tracer.settings() if self._tracer is not None else None
        self.rollout_edge = RolloutPoolEdge(cfg, run, self.runtime, trace=trace)
        self.train_edge = TrainingPoolEdge(cfg, run, self.runtime, trace=trace)
        self.executor = Executor(self.tracker, self.rollout_edge, self.train_edge, self.events, gate=self.gate)
        assert self.store is not None
        self.node_loss = NodeLossRecovery(
            cfg, self.runtime.live_gpus, self.store, self.tracker, self.executor, self.events,
            fingerprint_for=lambda tp: rollout_fingerprint(cfg, run, tp),
            train_problems=training_target_problems(cfg, run), wake=self.wake_reconciler,
            rollout_failed_within_s=rollout_spec(cfg, run, 1).health.hang_detection_bound_s,
            training_answers=self._training_answers, stopping=self.stop.event,
            placement_guard=self.runtime.placement_guard, reaches_again=node_reaches_peers_again)
        self.loop = ControlLoop(self.tracker, self.executor, self.rollout_edge, self.train_edge,
                                self.desired_state, self.events, self.options.timeouts,
                                self.options.tick_interval_s, on_observed=self._on_observed)
        self.reporter.set_state("starting", message="starting the rollout and training pools")
        self.loop.start()
        ready = self._wait_for_pools()
        if not ready:
            raise TimeoutError(
                f"the pools were not ready within {self.options.startup_timeout_s:.0f}s: {self._pool_summary()}; "
                f"see {run.events_jsonl} and {run.controller_log}"
            )
        self.events.emit("pools_ready", self._pool_summary())
        self.reporter.pools(self.pool_status())
        self.reporter.set_state("starting", message="pools ready")

    def _wait_for_pools(self) -> bool:
        """Wait until both pools are ready (False past the start-up timeout). A training pool whose ranks' nodes
        cannot reach each other fences off the fewest nodes that lets the rest connect and starts again at the
        size the GPUs left allow (`NodeLossRecovery.fence_at_start`), up to `MAX_FENCE_ROUNDS` times."""
        executor, node_loss, loop = self.executor, self.node_loss, self.loop
        assert executor is not None and node_loss is not None and loop is not None
        deadline = time.monotonic() + self.options.startup_timeout_s
        rounds = 0
        while True:
            ready = loop.wait_until(
                lambda: self._pools_ready() or executor.training_nodes_unreachable is not None,
                max(0.0, deadline - time.monotonic()), self.stop.event)
            if self.stop.requested:
                raise StopRequested()
            unreachable = executor.training_nodes_unreachable
            if unreachable is None:
                return ready
            executor.training_nodes_unreachable = None
            if rounds == MAX_FENCE_ROUNDS:
                break
            rounds += 1
            node_loss.fence_at_start(unreachable)
        raise TrainingNodesUnreachable(
            f"{unreachable}, also after fencing off {len(node_loss.fence.fenced())} nodes. The job does not start "
            "on nodes that cannot reach each other: mend the network between them (or take one out of the Ray "
            "cluster) and launch again")

    def _memory_dry_run(self) -> None:
        """With memory_budget_dry_run_enabled: one real recompute probe, compared with the planner's estimate."""
        if not self.cfg.global_resource_planner.memory_budget_dry_run_enabled:
            return
        from libra.controller.memory_dry_run import run_memory_dry_run

        assert self.desired is not None
        d = self.desired
        comparison = run_memory_dry_run(self.cfg, self.train_pool(), d.train_layout, d.train_gpus,
                                        self.run.root / "memory_dry_run.json")
        self.events.emit("memory_dry_run", comparison.message, ok=comparison.ok, rel_error=comparison.rel_error,
                         projected_peak_bytes=comparison.projected_peak_bytes)

    def _pools_ready(self) -> bool:
        assert self.tracker is not None and self.desired is not None
        return (
            self.tracker.counts(ROLLOUT).get("READY", 0) >= self.desired.rollout_instances
            and self.tracker.counts(TRAIN).get("READY", 0) >= self.desired.train_gpus
            and self.rollout_edge is not None and self.rollout_edge.pool is not None
            and self.train_edge is not None and self.train_edge.pool is not None
        )

    def _pool_summary(self) -> str:
        assert self.tracker is not None and self.desired is not None
        r, t = self.tracker.counts(ROLLOUT), self.tracker.counts(TRAIN)
        return (f"rollout {r.get('READY', 0)}/{self.desired.rollout_instances} ready {r}, "
                f"train {t.get('READY', 0)}/{self.desired.train_gpus} ready {t}")

    def _served_version(self) -> int:
        return self.rl.rollout_version if self.rl is not None else 0

    def pool_status(self) -> dict[str, Any]:
        assert self.tracker is not None and self.desired is not None
        d = self.desired
        return {
            ROLLOUT: {"desired_instances": d.rollout_instances, "tp": d.rollout_tp, "gpus": d.rollout_gpus,
                      "members": self.tracker.counts(ROLLOUT), "weight_version": self._served_version(),
                      "strategy": d.reconfigure_strategy, "reconfiguring": d.reconfiguring,
                      "generation": d.generation},
            TRAIN: {"gpus": d.train_gpus, "layout": d.train_layout.describe(d.train_gpus),
                    "members": self.tracker.counts(TRAIN), "planned": d.planned_training},
        }

    def pool_text(self) -> dict[str, str]:
        assert self.tracker is not None and self.desired is not None
        d = self.desired
        counts = self.tracker.counts(ROLLOUT)
        up = counts.get("READY", 0) + counts.get("LOADING", 0)  # LOADING here is mostly a weight reload
        return {
            ROLLOUT: f"{up}/{d.rollout_instances} up ({d.rollout_gpus} GPUs, v{self._served_version()})",
            TRAIN: f"{d.train_gpus} GPUs {d.train_layout.describe(d.train_gpus)}",
        }

    # ---- what the RL loop is given (JobSession) -------------------------------------------------------
    def session(self) -> JobSession:
        """The RL loop's view of the job: typed pool services and the controller's read-outs."""
        assert self.store is not None
        return JobSession(training=self.train_pool(), generation=self.rollout_pool(), desired=self.store,
                          publish_weights=self.publish_weights, served_versions=self.served_versions,
                          wake_reconciler=self.wake_reconciler, pool_status=self.pool_status,
                          pool_text=self.pool_text, tick_errors=self.tick_errors, after_step=self._after_step,
                          ehp_train_step=self._ehp_train_step(), training_loss=training_worker_loss,
                          restart_training=self._restart_training,
                          replan_onto_capacity=self._replan_onto_capacity)

    def _restart_training(self, exc: BaseException) -> dict[str, Any] | None:
        """A training pool that lost a worker (`exc`, classified by `training_worker_loss`) is started again (at
        the same layout, or re-planned onto the GPUs alive when the cluster lost some), through the executor's
        training resizer (member bookkeeping, weight gate); None when this job cannot restart it."""
        if self.executor is None or self.node_loss is None:
            return None
        first_line = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        return self.node_loss.restart_training(f"a training worker {training_worker_loss(exc) or 'died'}: "
                                               f"{first_line[:300]}")

    def _replan_onto_capacity(self) -> dict[str, Any] | None:
        """At a step boundary: the pools re-planned onto the GPUs alive when the cluster lost some."""
        return self.node_loss.replan(training_lost=False, observed=True) if self.node_loss is not None else None

    def _training_answers(self) -> bool:
        """Whether every rank of the training pool answers a call (False when one's process is gone)."""
        pool = self.train_edge.pool if self.train_edge is not None else None
        if pool is None or not pool.running:
            return False
        try:
            pool.worker_pids()
        except Exception:
            log.info("a training rank does not answer", exc_info=True)
            return False
        return True

    def _ehp_train_step(self) -> Callable[[list[Any], int, int], dict[str, float]] | None:
        """The training step with borrowed rollout GPUs when elastic hybrid parallelism acts in this job."""
        switch = ehp_switch(self.cfg)
        self.events.emit("ehp", f"elastic hybrid parallelism {switch.mode}: {switch.reason}", mode=switch.mode)
        if not switch.acts:
            return None
        assert self.tracker is not None
        borrower = EhpBorrower(self.cfg, switch, self.rollout_edge, self.train_edge, self.tracker, self.gate,
                               self.events, self.desired_state, observe_now=self.wake_reconciler,
                               reaches_again=node_reaches_peers_again)
        assert self.reporter is not None
        self.reporter.set_state("starting", message="starting the borrowed training replicas on rollout GPUs")
        self.borrower = borrower
        borrower.prewarm()
        return borrower.train_step

    def _after_step(self, rows: list[dict[str, Any]]) -> None:
        """Online re-planning at the step boundary; a failing decision is logged, never what stops the job."""
        if self.replanner is None:
            return
        try:
            self.replanner.after_step(rows)
        except Exception as exc:
            log.exception("online re-planning failed")
            self.events.emit("replan_error", f"{type(exc).__name__}: {exc}", step=self.step)

    def train_pool(self) -> TrainingService:
        if self.train_edge is None or self.train_edge.pool is None:
            raise RuntimeError("the training pool is not running")
        return cast(TrainingService, self.train_edge.pool)

    def rollout_pool(self) -> GenerationService:
        if self.rollout_edge is None or self.rollout_edge.pool is None:
            raise RuntimeError("the rollout pool is not running")
        return cast(GenerationService, self.rollout_edge.pool)

    def desired_state(self) -> DesiredState:
        assert self.store is not None
        return self.store.get()

    def served_versions(self) -> list[int]:
        """Weight versions the live rollout members hold by their last ACK (adopted servers may differ)."""
        assert self.tracker is not None
        return [m.weight_version for m in self.tracker.members(ROLLOUT) if m.live and m.weight_version is not None]

    def publish_weights(self, version: int, path: str, checksum: str) -> Any:
        """Publish version `version` to every rollout instance at a step boundary, through the executor's
        weight gate (a membership change waits; a new instance is later given the same weights)."""
        if self.executor is None:
            raise RuntimeError("the rollout pool is not running")
        outcome: PublishOutcome = self.executor.publish_weights(WeightsRef(version, path, checksum))
        return outcome.details.get("report", outcome.details)

    # ---- reconfiguration ------------------------------------------------------------------------------
    def reconfigure_limits(self) -> ReconfigureLimits:
        """What a reconfiguration request is checked against: the job's switches, the cluster, the model."""
        gpr = self.cfg.global_resource_planner
        return ReconfigureLimits(
            enabled=gpr.runtime_dynamic_reconfiguration_enabled,
            cluster_swap_enabled=gpr.runtime_cluster_swap_enabled,
            gpus_per_node=self.cfg.cluster.gpus_per_node,
            model=self.cfg.model_spec(),
            drain_before_stop=gpr.runtime_drain_before_reconfigure,
            fingerprint_for=lambda tp: rollout_fingerprint(self.cfg, self.run, tp),
            reconfigure_training=gpr.runtime_reconfigure_training,
            training_plan_only=gpr.runtime_training_pool_plan_only,
            train_problems=training_target_problems(self.cfg, self.run),
        )

    def observed_state(self) -> ObservedState | None:
        """The pools as the tracker sees them now (None before the pools start)."""
        return self.tracker.snapshot(time.time(), take_errors=False) if self.tracker is not None else None

    def request_reconfigure(self, target: ReconfigureTarget, strategy: str | None = None) -> DesiredState:
        """Reconfigure the rollout pool to `target` by `strategy` (default: the configured
        runtime_rollout_reconfigure_strategy). Checked at once (ReconfigureRefused names the problem); carried
        out by the control loop over the next ticks; `reconfigure_done` in the event log says when."""
        assert self.tracker is not None
        limits = self.reconfigure_limits()
        assert self.store is not None
        observed = self.tracker.snapshot(time.time(), take_errors=False)
        try:
            desired = self.store.change(lambda current: plan_reconfigure(current, target, strategy, limits, observed))
        except ValueError as exc:
            self.events.emit("reconfigure_refused", str(exc), target=target.describe(), strategy=strategy or "")
            raise
        if not desired.reconfiguring and desired.reason.startswith("plan only:"):
            record_plan_only(self.events, desired, target)  # runtime_training_pool_plan_only: nothing changes
            return desired
        self.events.emit("reconfigure_requested", desired.reconfiguring, generation=desired.generation,
                         strategy=desired.reconfigure_strategy, drain=desired.drain_before_stop)
        self.wake_reconciler()
        return desired

    def trigger_switch(self) -> DesiredState:
        """The trigger of a `prewarm` reconfiguration: the prewarmed instances take over serving."""
        assert self.store is not None
        desired = self.store.change(trigger_switch)
        self.events.emit("reconfigure_switch", desired.reconfiguring, generation=desired.generation)
        self.wake_reconciler()
        return desired

    def _on_observed(self, observed: ObservedState, desired: DesiredState) -> None:
        if self.node_loss is not None:
            self.node_loss.observe_capacity(force=any(m.state == MemberState.FAILED for m in observed.members))
            desired = self.desired_state()
        done = finish_if_converged(observed, desired)
        # a change made since this tick read the desired state is left for the next tick to judge
        if done is not None and self.store is not None and self.store.replace_if(desired, done):
            self.events.emit("reconfigure_done", desired.reconfiguring, generation=desired.generation,
                             strategy=desired.reconfigure_strategy, seconds=round(time.time() - desired.updated_at, 3))
            # the whole change, request to done, as the container of its reconfigure.* spans
            get_tracer().record("reconfigure.change", int(desired.updated_at * 1e9), now_ns(),
                                strategy=desired.reconfigure_strategy, change=desired.reconfiguring,
                                drain=desired.drain_before_stop)

    def wake_reconciler(self) -> None:
        if self.loop is not None:
            self.loop.poke()

    def tick_errors(self) -> int:
        return self.loop.tick_errors if self.loop is not None else 0

    # ---- shutdown -------------------------------------------------------------------------------------
    def _shutdown(self, outcome: str, error: str) -> None:
        steps = [
            ("stop the rollout producer", self._stop_producer),
            ("stop the control loop", self._stop_control_loop),
            ("save a checkpoint", self._final_checkpoint),
            ("finish copying checkpoints to the mirror", self._close_checkpoint_mirror),
            ("stop the parked borrowed training replicas", self._stop_borrowed),
            ("stop the rollout pool", self._stop_rollout),
            ("stop the training pool", self._stop_training),
            ("stop Ray", self._stop_ray),
            ("remove the CPU slices of the metered GPUs", self._remove_cpu_slices),
            ("close the tracer", self._close_tracer),
            ("close the metrics exporter", self._close_metrics),
            ("stop the operator API", self._stop_operator_api),
            ("withdraw the pools' device declaration", self._restore_pools_device),
        ]
        if self.reporter is not None:
            self.reporter.set_state("stopping", message=outcome)
        for what, action in steps:
            try:
                action()
            except BaseException as exc:  # clean-up continues whatever one step does
                log.warning("shutdown: could not %s: %s: %s", what, type(exc).__name__, exc)
                self.events.emit("shutdown_error", f"could not {what}: {type(exc).__name__}: {exc}")
        self.events.emit("shutdown", outcome, step=self.step, error=error)
        if self.reporter is not None:
            self.reporter.finish(outcome, step=self.step, error=error)
        bootstrap.remove_logging(self._log_handlers)

    def _stop_producer(self) -> None:
        if self.rl is not None:
            self.rl.stop_producer()

    def _stop_control_loop(self) -> None:
        """Stop ticking, then let actions in flight (a server still starting) finish so nothing leaks."""
        if self.loop is not None:
            self.loop.stop()
        if self.replanner is not None:  # no decision after the loop stopped; it leaves the event log
            self.replanner.close()
        if self.borrower is not None:
            self.borrower.stop_rechecks()
        if self.executor is not None:
            if not self.executor.wait_idle(900):
                log.warning("pool actions still running after 900s; stopping anyway")
            self.executor.shutdown(wait=False)
        if self.tracker is not None and self.store is not None:
            # a change finished since the last tick (a short resumed run) is recorded before the pools stop
            self._on_observed(self.tracker.snapshot(time.time(), take_errors=False), self.store.get())

    def _final_checkpoint(self) -> None:
        if self.rl is not None and self.train_edge is not None and self.train_edge.pool is not None:
            self.rl.final_checkpoint()

    def _close_checkpoint_mirror(self) -> None:
        if self.rl is not None:
            self.rl.close_mirror()

    def _stop_borrowed(self) -> None:
        if self.train_edge is not None:  # before the rollout pool: they run on its instances' GPUs
            self.train_edge.stop_borrowed("the job ends")

    def _stop_rollout(self) -> None:
        if self.rollout_edge is not None and self.rollout_edge.pool is not None:
            self.rollout_edge.pool.shutdown(keep_servers=self.options.keep_servers)
            self.rollout_edge.pool = None

    def _stop_training(self) -> None:
        if self.train_edge is not None and self.train_edge.pool is not None:
            self.train_edge.pool.shutdown()
            self.train_edge.pool = None

    def _stop_ray(self) -> None:
        if self.runtime is not None:
            bootstrap.stop_ray(self.runtime)
            self.runtime = None

    def _remove_cpu_slices(self) -> None:
        """Metered logical GPUs: the slices of holders that were killed (clean ones removed their own); the
        slices of servers kept running for the next launch stay with them."""
        if not self.options.keep_servers:
            from libra.config.mapping import cpu_metering
            from libra.metering.holder import end_job

            end_job(cpu_metering(self.cfg))

    def _start_operator_api(self) -> None:
        from libra.api.server import start_operator_api

        self.api = start_operator_api(self)

    def _stop_operator_api(self) -> None:
        if self.api is not None:
            self.api.stop()
            self.api = None

    def _close_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    def _close_tracer(self) -> None:
        if self._tracer is not None:
            self._tracer.close()
            set_tracer(PhaseTracer.disabled())
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


__all__ = ["Controller", "LaunchOptions", "MemberState", "RunResult"]
