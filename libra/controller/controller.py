"""The long-running controller of one job.

It prepares the run directory, decides the initial allocation (planner or pinned split), starts or joins
Ray, and hands the pools to the reconciler: the control loop creates them from the desired state and keeps
them there (replacing failed members, adopting servers left by an earlier controller). The RL loop then
runs on the main thread: a lag-bounded batch from the rollout producer -> advantages -> one training step
-> weight publish every `sync_interval` steps -> validated ACKs -> metrics, evaluation, checkpoints.

A stop request (SIGINT / SIGTERM, or `--max-steps`) ends the loop at a step boundary; the `finally` path
always stops the producer, saves a checkpoint, stops the pools, flushes traces and stops the Ray cluster
it started. A launch on an existing run directory resumes from its newest complete checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from libra.config import Config, dump
from libra.controller import bootstrap
from libra.controller.allocation import initial_allocation
from libra.controller.batching import CollectionCancelled, SampleBuffer
from libra.controller.checkpoints import CheckpointStore, ControllerState
from libra.controller.control_loop import ControlLoop
from libra.controller.events import EventLog
from libra.controller.executor import Executor
from libra.controller.members import MemberState, StateTimeouts
from libra.controller.pools import RolloutPoolEdge, TrainingPoolEdge, check_pool_specs
from libra.controller.producer import RolloutProducer, SamplingSettings
from libra.controller.reporting import Reporter
from libra.controller.rl_step import build_samples, rollout_metrics
from libra.controller.signals import StopRequest
from libra.controller.state import ROLLOUT, TRAIN, DesiredState
from libra.controller.tracker import MemberTracker
from libra.observability.console import make_console
from libra.observability.metrics import LibraMetrics
from libra.observability.phase_trace import ENV_DIR, ENV_ENABLE, PhaseTracer, get_tracer, set_tracer
from libra.run_dir import RunDir, truncate_jsonl_after_step, write_json_atomic

log = logging.getLogger(__name__)

PHASES = ("rollout", "train", "sync", "eval", "checkpoint")


class StopRequested(Exception):
    pass


@dataclass(frozen=True)
class LaunchOptions:
    max_steps: int = 0  # stop once this global step is reached (0 = total_steps)
    console: str = ""  # override tracking.console
    keep_servers: bool = False  # leave rollout servers running at exit (for adoption by the next launch)
    startup_timeout_s: float = 1800.0
    tick_interval_s: float = 1.0
    curve_interval_s: float = 30.0
    install_signal_handlers: bool = True
    timeouts: StateTimeouts = field(default_factory=StateTimeouts)


@dataclass
class RunResult:
    outcome: str  # finished | interrupted | failed
    start_step: int
    step: int
    error: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)


class Controller:
    def __init__(self, cfg: Config, run: RunDir, options: LaunchOptions | None = None) -> None:
        self.cfg = cfg
        self.run = run
        self.options = options or LaunchOptions()
        self.stop = StopRequest()
        self.events = EventLog(None)
        self.state = ControllerState()
        self.start_step = 0
        self.end_step = min(cfg.total_steps, self.options.max_steps or cfg.total_steps)
        self.timings = {phase: 0.0 for phase in PHASES} | {"loop": 0.0}
        self.rows: list[dict[str, Any]] = []
        self.runtime: Any = None
        self.desired: DesiredState | None = None
        self.tracker: MemberTracker | None = None
        self.executor: Executor | None = None
        self.loop: ControlLoop | None = None
        self.rollout_edge: RolloutPoolEdge | None = None
        self.train_edge: TrainingPoolEdge | None = None
        self.producer: RolloutProducer | None = None
        self.buffer: SampleBuffer | None = None
        self.metrics: LibraMetrics | None = None
        self.reporter: Reporter | None = None
        self.task: Any = None
        self.tokenizer: Any = None
        self._tracer: PhaseTracer | None = None
        self._log_handlers: list[logging.Handler] = []
        self._last_checkpoint_step = -1
        self._rollout_version = 0
        self._loop_started: float | None = None
        self._saved_env: dict[str, str | None] = {}

    # ---- entry point ----------------------------------------------------------------------------------
    def run_job(self) -> RunResult:
        outcome, error = "failed", ""
        if self.options.install_signal_handlers:
            self.stop.install()
        try:
            self._prepare()
            self._bootstrap()
            self._start_pools()
            self._restore()
            self._train_loop()
            outcome = "interrupted" if self.stop.requested and self.state.step < self.end_step else "finished"
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
        return RunResult(outcome, self.start_step, self.state.step, error, dict(self.timings), self.rows)

    # ---- setup ----------------------------------------------------------------------------------------
    def _prepare(self) -> None:
        run, cfg = self.run, self.cfg
        resuming = run.is_existing_run()
        run.create()
        self._log_handlers = bootstrap.setup_logging(run, cfg.log_level)
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
        if "prometheus" in cfg.tracking.backends or cfg.tracking.prometheus_port > 0:
            self.metrics = LibraMetrics()
            if cfg.tracking.prometheus_port > 0:
                port = self.metrics.serve(cfg.tracking.prometheus_port)
                self.events.emit("prometheus", f"metrics on http://127.0.0.1:{port}/metrics", port=port)
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
        if cfg.build_tiny_model.enabled:
            self.reporter.set_state("starting", message="building the tiny model")
            bootstrap.ensure_tiny_model(cfg)
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
        self._set_desired(desired)
        check_pool_specs(cfg, run, desired)
        self.reporter.set_state("starting", message="starting Ray")
        self.runtime = bootstrap.start_ray(cfg, namespace=f"libra-{cfg.name or 'job'}")
        self.events.emit("ray", "joined Ray" if not self.runtime.owned else "started a local Ray",
                         address=self.runtime.address)
        self.tokenizer = bootstrap.load_tokenizer(cfg)
        from libra.data import build_task

        self.task = build_task(cfg.task, self.tokenizer)

    def _set_desired(self, desired: DesiredState) -> None:
        self.desired = desired
        desired.save(self.run.desired_state_json)

    def _start_pools(self) -> None:
        cfg, run = self.cfg, self.run
        assert self.reporter is not None and self.desired is not None
        self.tracker = MemberTracker(self.events)
        self.rollout_edge = RolloutPoolEdge(cfg, run, self.runtime)
        self.train_edge = TrainingPoolEdge(cfg, run, self.runtime)
        self.executor = Executor(self.tracker, self.rollout_edge, self.train_edge, self.events)
        self.loop = ControlLoop(self.tracker, self.executor, self.rollout_edge, self.train_edge,
                                lambda: self._desired(), self.events, self.options.timeouts,
                                self.options.tick_interval_s)
        self.reporter.set_state("starting", message="starting the rollout and training pools")
        self.loop.start()
        ready = self.loop.wait_until(self._pools_ready, self.options.startup_timeout_s, self.stop.event)
        if self.stop.requested:
            raise StopRequested()
        if not ready:
            raise TimeoutError(
                f"the pools were not ready within {self.options.startup_timeout_s:.0f}s: {self._pool_summary()}; "
                f"see {run.events_jsonl} and {run.controller_log}"
            )
        self.events.emit("pools_ready", self._pool_summary())
        self.reporter.pools(self._pool_status())
        self.reporter.set_state("starting", message="pools ready")

    def _desired(self) -> DesiredState:
        assert self.desired is not None
        return self.desired

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

    def _pool_status(self) -> dict[str, Any]:
        assert self.tracker is not None and self.desired is not None
        d = self.desired
        return {
            ROLLOUT: {"desired_instances": d.rollout_instances, "tp": d.rollout_tp, "gpus": d.rollout_gpus,
                      "members": self.tracker.counts(ROLLOUT), "weight_version": self._rollout_version},
            TRAIN: {"gpus": d.train_gpus, "layout": d.train_layout.describe(d.train_gpus),
                    "members": self.tracker.counts(TRAIN)},
        }

    def _pool_text(self) -> dict[str, str]:
        assert self.tracker is not None and self.desired is not None
        d = self.desired
        ready = self.tracker.counts(ROLLOUT).get("READY", 0)
        return {
            ROLLOUT: f"{ready}/{d.rollout_instances} ready ({d.rollout_gpus} GPUs, v{self._rollout_version})",
            TRAIN: f"{d.train_gpus} GPUs {d.train_layout.describe(d.train_gpus)}",
        }

    # ---- resume ---------------------------------------------------------------------------------------
    def _restore(self) -> None:
        cfg, run = self.cfg, self.run
        assert self.reporter is not None
        store = self._store()
        latest = store.latest() if cfg.checkpoint.resume else None
        if latest is not None:
            state, train_dir = latest
            self.reporter.set_state("starting", message=f"resuming from step {state.step}")
            with get_tracer().span("checkpoint.load", step=state.step):
                loaded = self._train_pool().load_checkpoint(str(train_dir))
            if int(loaded) != state.step:
                self.events.emit("warning", f"training checkpoint reports step {loaded}, controller state {state.step}")
            state.sessions += 1
            self.state = state
            self._last_checkpoint_step = state.step
            self.events.emit("resumed", f"resumed from step {state.step}", step=state.step, checkpoint=str(train_dir))
        else:
            self.state = ControllerState(sessions=1)
        dropped = truncate_jsonl_after_step(run.metrics_jsonl, self.state.step) if run.metrics_jsonl.exists() else 0
        if dropped:
            self.events.emit("metrics_truncated", f"dropped {dropped} metric rows after step {self.state.step}")
        self.start_step = self.state.step
        self._make_producer()
        self._align_rollout_weights(self.state.step)

    def _align_rollout_weights(self, step: int) -> None:
        """Make the rollout servers serve the trainer's weights of `step` (adopted servers may hold others)."""
        assert self.tracker is not None and self.desired is not None
        served = [v for m in self.tracker.members(ROLLOUT) if m.live
                  if isinstance(v := m.info.get("weight_version"), int)]
        offset = self.desired.rollout_version_offset
        if served and max(served) > step + offset:
            offset = max(served) - step
            self._set_desired(dataclasses.replace(self.desired, rollout_version_offset=offset))
            self.events.emit("version_offset", f"adopted servers hold publish version {max(served)}, newer than "
                             f"the checkpoint (step {step}); policy versions are published with offset {offset}",
                             offset=offset)
        if step > 0 or any(v != step + offset for v in served):
            self._publish(step, reason="bring the rollout servers to the trainer's weights")
        else:
            self._mark_rollout_version(step)

    async def _generate(self, prompt_ids: list[int], **sampling: Any) -> list[Any]:
        """The rollout pool's `generate`, with publish versions mapped back to policy versions."""
        offset = self._desired().rollout_version_offset
        completions = await self._rollout_pool().generate(prompt_ids, **sampling)
        if not offset:
            return list(completions)
        return [dataclasses.replace(c, weight_version=c.weight_version - offset) for c in completions]

    def _make_producer(self) -> None:
        cfg = self.cfg
        prompts = self.task.train_prompts(cfg.seed)
        if self.state.prompts_drawn:
            prompts = itertools.islice(prompts, self.state.prompts_drawn, None)
        self.buffer = SampleBuffer(
            batch_size=cfg.batch_size,
            group_size=cfg.n_samples,
            max_offpolicyness=cfg.max_head_offpolicyness,
            max_concurrent_samples=cfg.effective_max_concurrent_rollouts,
            next_step=self.state.step,
            rollout_version=self.state.step,
        )
        self.producer = RolloutProducer(
            self._generate,
            prompts,
            self._score,
            self.buffer,
            SamplingSettings(cfg.n_samples, cfg.max_new_tokens, cfg.rollout_temperature, cfg.rollout_top_p, cfg.seed),
            self.events,
            prompts_drawn=self.state.prompts_drawn,
        )

    def _score(self, prompt: Any, response_ids: list[int]) -> float:
        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        return float(self.task.reward(prompt, response_ids, text))

    # ---- the RL loop ----------------------------------------------------------------------------------
    def _train_loop(self) -> None:
        assert self.producer is not None and self.reporter is not None
        if self.state.step >= self.end_step:
            self.events.emit("nothing_to_do", f"step {self.state.step} already reached {self.end_step}")
            return
        self.producer.start()
        self.reporter.set_state("running", step=self.state.step)
        loop_started = self._loop_started = time.monotonic()
        last_tokens, last_time = self.producer.response_tokens, time.monotonic()
        try:
            while self.state.step < self.end_step and not self.stop.requested:
                row = self._one_step()
                now = time.monotonic()
                row["rollout_tokens_per_s"] = (self.producer.response_tokens - last_tokens) / max(1e-9, now - last_time)
                last_tokens, last_time = self.producer.response_tokens, now
                self.timings["loop"] = time.monotonic() - loop_started
                row["elapsed_s"] = round(self.state.train_seconds + self.timings["loop"], 3)
                self.rows.append(row)
                assert self.tracker is not None and self.loop is not None
                self.reporter.pools(self._pool_status())
                self.reporter.step(row, self._pool_text(), self.buffer.depth() if self.buffer else {},
                                   {"tick_errors": self.loop.tick_errors, "rollout_failures": self.producer.failures})
        finally:
            self.timings["loop"] = time.monotonic() - loop_started
            self.state.train_seconds += self.timings["loop"]
            self._loop_started = None

    def _one_step(self) -> dict[str, Any]:
        from libra.training.spec import TrainSample

        cfg = self.cfg
        assert self.buffer is not None and self.producer is not None
        index = self.state.step  # 0-based index of this step = the policy version it trains
        number = index + 1
        gpr = cfg.global_resource_planner
        times: dict[str, float] = {}
        started = time.monotonic()
        with get_tracer().span("controller.step", step=number):
            with get_tracer().span("batch.collect", step=number):
                groups, stats = self.buffer.collect(
                    index, gpr.runtime_batch_collection_timeout_s, gpr.runtime_batch_collection_max_retries,
                    cancelled=self.stop.event, on_timeout=self._on_collect_timeout,
                )
            times["rollout"] = time.monotonic() - started
            samples = build_samples(groups, cfg.algorithm.advantage_norm_mode, TrainSample)
            t = time.monotonic()
            train_metrics = self._train_pool().train_step(samples, step=number)
            times["train"] = time.monotonic() - t
            self.state.step = number
            self.state.prompts_drawn = self.producer.prompts_drawn - self.buffer.running - self.buffer.buffered
            self.state.discarded_groups = self.buffer.discarded_groups
            self.state.discarded_samples = self.buffer.discarded_samples
            self.state.rollout_failures = self.producer.failures
            sync: dict[str, Any] = {}
            t = time.monotonic()
            if number % cfg.sync_interval == 0 and number < self.end_step:
                sync = self._publish(number, reason=f"sync_interval {cfg.sync_interval}")
            times["sync"] = time.monotonic() - t
            evaluation: dict[str, float] = {}
            t = time.monotonic()
            if cfg.task.eval_interval and (number % cfg.task.eval_interval == 0 or number == self.end_step):
                evaluation = self._evaluate(number)
            times["eval"] = time.monotonic() - t
            t = time.monotonic()
            interval = cfg.checkpoint.interval_steps
            if interval and number % interval == 0:
                self._checkpoint()
            times["checkpoint"] = time.monotonic() - t
        for phase, seconds in times.items():
            self.timings[phase] += seconds
        row: dict[str, Any] = {"step": number, "wall_time": round(time.time(), 3)}
        row.update(rollout_metrics(groups, index))
        row.update({f"train_{k}": v for k, v in train_metrics.items() if isinstance(v, int | float)})
        row.update({f"time_{k}_s": round(v, 4) for k, v in times.items()})
        row["time_step_s"] = round(time.monotonic() - started, 4)
        train_tokens = float(train_metrics.get("tokens", 0) or 0)
        row["train_tokens_per_s"] = train_tokens / times["train"] if times["train"] > 0 else 0.0
        row.update(
            policy_version=number,
            rollout_version=self._rollout_version,
            discarded_samples=stats.discarded_samples,
            discarded_samples_total=self.buffer.discarded_samples,
            collect_attempts=stats.attempts,
            rollout_instances=self._desired().rollout_instances,
            rollout_gpus=self._desired().rollout_gpus,
            train_gpus=self._desired().train_gpus,
            queue_running=self.buffer.running,
            queue_buffered=self.buffer.buffered,
        )
        if evaluation:
            row.update({f"eval_{k}": v for k, v in evaluation.items()})
        for key, value in sync.items():
            row[f"sync_{key}"] = value
        return row

    def _on_collect_timeout(self, attempt: int, have: int) -> None:
        assert self.buffer is not None and self.loop is not None
        self.events.emit(
            "batch_timeout",
            f"collected {have} of {self.cfg.batch_size} groups; retry {attempt} of "
            f"{self.cfg.global_resource_planner.runtime_batch_collection_max_retries}",
            running=self.buffer.running,
        )
        self.loop.poke()

    # ---- weights, evaluation, checkpoints -------------------------------------------------------------
    def _publish(self, version: int, reason: str) -> dict[str, Any]:
        out = self.run.weights_dir(version)
        started = time.monotonic()
        with get_tracer().span("weight_sync.publish", step=version, flow_id=version, version=version):
            checksum = self._train_pool().export_hf(str(out))
            publish_version = version + self._desired().rollout_version_offset
            report = self._rollout_pool().publish_weights(publish_version, str(out), checksum)
        seconds = time.monotonic() - started
        self._mark_rollout_version(version)
        self.run.prune_weights(keep={version})
        details = _report_fields(report)
        self.events.emit("weight_sync", reason, version=version, seconds=round(seconds, 3), **details)
        return {"total_s": round(seconds, 4), **details}

    def _mark_rollout_version(self, version: int) -> None:
        assert self.buffer is not None and self.tracker is not None and self.desired is not None
        self._rollout_version = version
        self.buffer.set_rollout_version(version)
        self.tracker.set_weight_version(version)
        self._set_desired(_replace_version(self.desired, version))

    def _evaluate(self, number: int) -> dict[str, float]:
        from libra.data import evaluate

        assert self.producer is not None
        cfg = self.cfg
        pool = self._rollout_pool()

        async def generate_all(prompts: Sequence[Any]) -> list[tuple[list[int], str]]:
            outs = await asyncio.gather(*(
                pool.generate(list(p.token_ids), n=1, max_new_tokens=cfg.max_new_tokens, temperature=0.0,
                              top_p=1.0, seed=cfg.seed)
                for p in prompts
            ))
            return [(list(o[0].token_ids), self.tokenizer.decode(list(o[0].token_ids), skip_special_tokens=True))
                    for o in outs]

        def generate_fn(prompts: list[Any]) -> list[tuple[list[int], str]]:
            return self.producer.run_coroutine(generate_all(prompts), timeout=600.0)  # type: ignore[union-attr]

        with get_tracer().span("eval", step=number):
            result = evaluate(generate_fn, self.task, n=cfg.task.eval_size)
        if self.state.best_eval_accuracy is None or result["accuracy"] > self.state.best_eval_accuracy:
            self.state.best_eval_accuracy = result["accuracy"]
        self.events.emit("eval", f"accuracy {result['accuracy']:.3f} on {int(result['num_prompts'])} prompts",
                         step=number, **result)
        return result

    def _store(self) -> CheckpointStore:
        return CheckpointStore(self.run, self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_every)

    def _checkpoint(self) -> None:
        step = self.state.step
        if step == self._last_checkpoint_step:
            return
        store = self._store()
        with get_tracer().span("checkpoint.save", step=step):
            target = store.begin(step)
            self._train_pool().save_checkpoint(str(target), step)
            snapshot = ControllerState.from_dict(self.state.to_dict())
            if self._loop_started is not None:
                snapshot.train_seconds += time.monotonic() - self._loop_started
            folder = store.commit(snapshot)
        self._last_checkpoint_step = step
        self.events.emit("checkpoint", f"saved step {step}", step=step, path=str(folder))

    # ---- pool access ----------------------------------------------------------------------------------
    def _train_pool(self) -> Any:
        if self.train_edge is None or self.train_edge.pool is None:
            raise RuntimeError("the training pool is not running")
        return self.train_edge.pool

    def _rollout_pool(self) -> Any:
        if self.rollout_edge is None or self.rollout_edge.pool is None:
            raise RuntimeError("the rollout pool is not running")
        return self.rollout_edge.pool

    # ---- shutdown -------------------------------------------------------------------------------------
    def _shutdown(self, outcome: str, error: str) -> None:
        steps = [
            ("stop the rollout producer", self._stop_producer),
            ("stop the control loop", self._stop_control_loop),
            ("save a checkpoint", self._final_checkpoint),
            ("stop the rollout pool", self._stop_rollout),
            ("stop the training pool", self._stop_training),
            ("stop Ray", self._stop_ray),
            ("close the tracer", self._close_tracer),
            ("close the metrics exporter", self._close_metrics),
        ]
        if self.reporter is not None:
            self.reporter.set_state("stopping", message=outcome)
        for what, action in steps:
            try:
                action()
            except BaseException as exc:  # clean-up continues whatever one step does
                log.warning("shutdown: could not %s: %s: %s", what, type(exc).__name__, exc)
                self.events.emit("shutdown_error", f"could not {what}: {type(exc).__name__}: {exc}")
        self.events.emit("shutdown", outcome, step=self.state.step, error=error)
        if self.reporter is not None:
            self.reporter.finish(outcome, step=self.state.step, error=error)
        bootstrap.remove_logging(self._log_handlers)

    def _stop_producer(self) -> None:
        if self.producer is not None:
            self.producer.stop()

    def _stop_control_loop(self) -> None:
        """Stop ticking, then let actions in flight (a server still starting) finish so nothing leaks."""
        if self.loop is not None:
            self.loop.stop()
        if self.executor is not None:
            if not self.executor.wait_idle(900):
                log.warning("pool actions still running after 900s; stopping anyway")
            self.executor.shutdown(wait=False)

    def _final_checkpoint(self) -> None:
        if self.train_edge is None or self.train_edge.pool is None:
            return
        if self.state.step > 0 and self.state.step != self._last_checkpoint_step:
            self._checkpoint()

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


def _report_fields(report: Any) -> dict[str, Any]:
    """The figures of a rollout `ReloadReport` worth a metric: whole-batch reload time, the slowest
    instance, and how many ACKs were validated."""
    fields = {
        "reload_s": getattr(report, "total_s", None),
        "slowest_instance": getattr(report, "slowest_instance", None),
        "slowest_instance_s": getattr(report, "slowest_total_s", None),
        "acks_validated": getattr(report, "acks_validated", None),
        "method": getattr(report, "method", None),
    }
    return {k: v for k, v in fields.items() if isinstance(v, int | float | str)}


def _replace_version(desired: DesiredState, version: int) -> DesiredState:
    return dataclasses.replace(desired, weight_version=version)


__all__ = ["Controller", "LaunchOptions", "MemberState", "RunResult"]
