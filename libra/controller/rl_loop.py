"""The RL loop of one controller session, on the main thread.

Each step: a lag-bounded batch from the rollout producer -> advantages -> one optimizer step on the
training pool -> weight publish every `sync_interval` steps (the training ranks export the weights, then one
reload request, validated ACK batch) -> evaluation and checkpoint files when due -> one metrics row -> the
checkpoint marked complete. A checkpoint is complete only once its step's row is written, so a controller
killed in between resumes from the checkpoint before (the step is trained again) and never after a step
without a row. Resuming loads the newest complete checkpoint and brings the rollout servers to its weights
first.

Under a policy lag (`max_head_offpolicyness` >= 1) the next batch may come from the weights before a publish,
so only the export holds the loop: the rollout servers reload on a helper thread while the next step collects
and trains, and the loop waits for that reload's ACK batch at the next step's sync point (before the next
export; the lag bound holds either way, as the buffer admits groups by the version the servers serve). The
figures of a publish land in the row of the step that waited for it, with `sync_version`. A synchronous job
(its next batch needs the new weights, and elastic hybrid parallelism lends its rollout GPUs to the next
training step) waits for the ACKs at once.

Evaluation runs beside the next step's rollout: the held-out prompts go to the rollout pool right after the
publish of step N (so they see policy N; behind the loop, once that reload has its ACKs), and their result is
taken before step N+1 trains (under a policy lag once it has trained, so that the training overlaps the
reload the evaluation waits for), ahead of the next publish. The figures land in step N+1's metrics row with
`eval_step: N`. The last step evaluates in the foreground, so its own row carries them.

The loop is given a `JobSession` (typed training and generation services, the desired-state store, the
weight publish through the executor's gate, pool read-outs), never the controller itself.

A training worker that dies (its process killed or crashed) fails the training call of the step in flight
(a train step, the export of a publish, a checkpoint save). The job goes on without a human: the session
restarts the training pool at the same layout, and the loop resumes as a new launch would, from the newest
complete checkpoint (a checkpoint the dead worker left half-written is never complete), dropping the metric
rows after it and drawing the prompts again from its position; the steps after that checkpoint are trained
again. A worker lost more than `runtime_training_restart_limit` times in a row, with no checkpoint saved in
between, fails the job.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, cast

from libra.config import Config
from libra.controller.batching import SampleBuffer
from libra.controller.checkpoint_mirror import CheckpointMirror
from libra.controller.checkpoints import (
    CheckpointStore,
    ControllerState,
    checkpoint_step,
    disk_full_error,
    restore_newest,
    retained_steps,
    weights_disk_full_error,
)
from libra.controller.events import EventLog
from libra.controller.producer import RolloutProducer, SamplingSettings
from libra.controller.prompt_ledger import PromptLedger
from libra.controller.reporting import Reporter
from libra.controller.rl_step import build_samples, rollout_metrics
from libra.controller.services import JobSession
from libra.controller.signals import StopRequest
from libra.controller.step_gate import StepGate
from libra.observability.phase_trace import get_tracer
from libra.run_dir import RunDir, truncate_jsonl_after_step

PHASES = ("rollout", "train", "sync", "eval", "checkpoint")


class TrainingWorkersLostError(RuntimeError):
    """The training pool lost a worker again and again: the job stops instead of restarting it forever."""


class RLLoop:
    def __init__(self, cfg: Config, run: RunDir, session: JobSession, events: EventLog, reporter: Reporter,
                 task: Any, tokenizer: Any, stop: StopRequest, end_step: int, gate: StepGate | None = None) -> None:
        self.cfg = cfg
        self.gate = gate  # operator pause / drain, asked at each step boundary
        self.run = run
        self.session = session
        self.events = events
        self.reporter = reporter
        self.task = task
        self.tokenizer = tokenizer
        self.stop = stop
        self.end_step = end_step
        self.state = ControllerState()
        self.start_step = 0
        self.rollout_version = 0
        self.timings = {phase: 0.0 for phase in PHASES} | {"loop": 0.0}
        self.rows: list[dict[str, Any]] = []
        self.buffer: SampleBuffer | None = None
        self.producer: RolloutProducer | None = None
        self.prompt_ledger = PromptLedger()  # which prompts are done: where a resume draws from
        self.store = CheckpointStore(run, cfg.checkpoint.keep_last, cfg.checkpoint.keep_every)
        self.mirror = self._make_mirror(cfg.checkpoint.mirror_dir)
        self._last_checkpoint_step = -1
        self._saved_checkpoint_step: int | None = None  # written, not yet complete (waits for the step's row)
        self._reported_step = 0  # the newest step whose metrics row was written (or loaded at resume)
        self._disk_full = False  # a checkpoint write met a full disk: no second try at shutdown
        self._loop_started: float | None = None
        self._eval_runner: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending_eval: tuple[int, concurrent.futures.Future[dict[str, float]]] | None = None
        self._publisher: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending_publish: tuple[int, concurrent.futures.Future[dict[str, Any]]] | None = None
        self.training_restarts = 0  # in this session
        self._step_in_flight = 0
        self._restarts_in_a_row = 0  # since the last checkpoint saved
        self._training_state_lost = False  # a worker died and no checkpoint is loaded yet: nothing to save

    def _make_mirror(self, mirror_dir: str) -> CheckpointMirror | None:
        if not mirror_dir:
            return None
        keep_last, keep_every = self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_every

        def mirrored(step: int, path: Path, seconds: float) -> None:
            self.events.emit("checkpoint_mirrored", f"step {step} copied to {path} in {seconds:.1f}s", step=step,
                             path=str(path), seconds=round(seconds, 3))

        return CheckpointMirror(Path(mirror_dir), lambda steps: retained_steps(steps, keep_last, keep_every),
                                lambda message: self.events.emit("warning", message), mirrored)

    def close_mirror(self) -> None:
        """Wait until every committed checkpoint is copied to the mirror (the job's last one included)."""
        if self.mirror is not None:
            self.mirror.close()

    # ---- resume ---------------------------------------------------------------------------------------
    def restore(self) -> None:
        """Load the newest checkpoint (if any), set up the producer, align the rollout weights."""
        self._load_newest(self.cfg.checkpoint.resume)
        self._make_producer()
        self._align_rollout_weights(self.state.step)

    def _load_newest(self, use_checkpoints: bool, after: str = "") -> None:
        """Load the newest checkpoint that loads into the training pool and take its controller state (a fresh
        state without one); drop the metric rows after its step. `after` names what made a running loop
        go back to it (then the session's counters are kept)."""
        def load(train_dir: str) -> int:
            self.reporter.set_state("starting", message=f"resuming from {train_dir}")
            with get_tracer().span("checkpoint.load", step=checkpoint_step(train_dir)):
                return int(self.session.training.load_checkpoint(train_dir))

        def warn(message: str) -> None:
            self.events.emit("warning", message)

        # the newest checkpoint that loads; damaged ones are restored from the mirror (when the job keeps one) or
        # skipped, with a warning naming the file
        latest = restore_newest(self.store, load, warn, self.mirror) if use_checkpoints else None
        current = self.state
        if latest is not None:
            state, train_dir, loaded = latest
            if int(loaded) != state.step:
                self.events.emit("warning", f"training checkpoint reports step {loaded}, controller state {state.step}")
            state.sessions += 1
            self.state = state
            self._last_checkpoint_step = state.step
            self.events.emit("resumed", f"resumed from step {state.step}" + (f" after {after}" if after else ""),
                             step=state.step, checkpoint=str(train_dir))
        else:
            self.state = ControllerState(sessions=1)
            self._last_checkpoint_step = -1
            if after:
                self.events.emit("resumed", f"started again from step 0 after {after} (no checkpoint yet)", step=0)
        if after:  # the same session goes on: its wall time and launch count are not the checkpoint's
            self.state.sessions, self.state.train_seconds = current.sessions, current.train_seconds
        metrics = self.run.metrics_jsonl
        self.reporter.drop_rows_after(self.state.step)
        dropped = truncate_jsonl_after_step(metrics, self.state.step) if metrics.exists() else 0
        if dropped:
            self.events.emit("metrics_truncated", f"dropped {dropped} metric rows after step {self.state.step}")
        self.rows = [row for row in self.rows if int(row["step"]) <= self.state.step]
        self._reported_step = self.state.step
        if not after:
            self.start_step = self.state.step

    def _align_rollout_weights(self, step: int) -> None:
        """Make the rollout servers serve the trainer's weights of `step` (adopted servers may hold others)."""
        served = self.session.served_versions()
        desired = self.session.desired.get()
        offset = desired.rollout_version_offset
        # Only servers fresh from model_path (version 0) serving a fresh trainer are known to hold its weights.
        fresh = step == 0 and offset == 0 and all(v == 0 for v in served)
        if served and max(served) > step + offset:
            offset = max(served) - step
            self.session.desired.update(rollout_version_offset=offset)
            self.events.emit("version_offset", f"adopted servers hold publish version {max(served)}, newer than "
                             f"the checkpoint (step {step}); policy versions are published with offset {offset}",
                             offset=offset)
        if not fresh:
            self.publish(step, reason="bring the rollout servers to the trainer's weights")
        else:
            self._mark_rollout_version(step)

    def _make_producer(self) -> None:
        cfg = self.cfg
        prompts = self.task.train_prompts(cfg.seed)
        self.prompt_ledger = PromptLedger(self.state.prompts_drawn, set(self.state.prompts_done_ahead))
        if self.prompt_ledger.position:
            prompts = itertools.islice(prompts, self.prompt_ledger.position, None)
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
            prompts_drawn=self.prompt_ledger.position,
            skip=self.prompt_ledger.done_ahead,
        )

    async def _generate(self, prompt_ids: list[int], **sampling: Any) -> list[Any]:
        """The rollout pool's `generate`, with publish versions mapped back to policy versions."""
        offset = self.session.desired.get().rollout_version_offset
        completions = await self.session.generation.generate(prompt_ids, **sampling)
        if not offset:
            return list(completions)
        # completions are frozen dataclasses (`libra.rollout.Completion`)
        return [dataclasses.replace(cast(Any, c), weight_version=c.weight_version - offset) for c in completions]

    def _score(self, prompt: Any, response_ids: list[int]) -> float:
        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        return float(self.task.reward(prompt, response_ids, text))

    # ---- the loop -------------------------------------------------------------------------------------
    def run_steps(self) -> None:
        assert self.producer is not None and self.buffer is not None
        if self.state.step >= self.end_step:
            self.events.emit("nothing_to_do", f"step {self.state.step} already reached {self.end_step}")
            return
        self.producer.start()
        self.reporter.set_state("running", step=self.state.step)
        loop_started = self._loop_started = time.monotonic()
        last_tokens, last_time, last_busy = self.producer.response_tokens, time.monotonic(), self.producer.busy.total()
        try:
            while self.state.step < self.end_step and not self.stop.requested:
                if self.gate is not None and not self.gate.proceed(self.stop.event, self._on_hold):
                    break
                row: dict[str, Any] | None = None
                try:
                    if not self._replanned_onto_capacity():
                        row = self._one_step()
                except Exception as exc:
                    if not self._recover_training(exc):
                        raise
                if row is None:  # back to the newest checkpoint: the step starts again
                    self.producer.start()
                    last_tokens, last_time = self.producer.response_tokens, time.monotonic()
                    last_busy = self.producer.busy.total()
                    continue
                now = time.monotonic()
                row["rollout_tokens_per_s"] = (self.producer.response_tokens - last_tokens) / max(1e-9, now - last_time)
                # what online re-planning measures: generated tokens and generating seconds since the last row
                busy = self.producer.busy.total()
                row.update(rollout_tokens=self.producer.response_tokens - last_tokens,
                           rollout_busy_s=round(busy - last_busy, 4), interval_s=round(now - last_time, 4))
                last_tokens, last_time, last_busy = self.producer.response_tokens, now, busy
                self.timings["loop"] = now - loop_started
                row["elapsed_s"] = round(self.state.train_seconds + self.timings["loop"], 3)
                self.rows.append(row)
                if self.session.after_step is not None:
                    self.session.after_step(self.rows)
                self.reporter.pools(self.session.pool_status())
                self.reporter.step(row, self.session.pool_text(), self.buffer.depth(),
                                   {"tick_errors": self.session.tick_errors(), "rollout_failures": self.producer.failures})
                if not self.reporter.rows_pending:  # held rows (a full disk) count once they are written
                    self._reported_step = int(row["step"])
                self._commit_saved_checkpoint()
        finally:
            self._settle_pending_evaluation()
            self._settle_pending_publish()
            self.timings["loop"] = time.monotonic() - loop_started
            self.state.train_seconds += self.timings["loop"]
            self._loop_started = None

    def _recover_training(self, exc: Exception) -> bool:
        """After a training call failed: when a worker died or hung, the session restarts the training pool and
        the loop goes back to the newest complete checkpoint with a new producer; False for any other error."""
        restart, loss = self.session.restart_training, self.session.training_loss
        how = loss(exc) if loss is not None else ""
        if restart is None or not how:
            return False
        step = self._step_in_flight
        limit = self.cfg.global_resource_planner.runtime_training_restart_limit
        if self._restarts_in_a_row >= limit:
            raise TrainingWorkersLostError(
                f"the training pool lost a worker {self._restarts_in_a_row + 1} times in a row without saving a "
                f"checkpoint in between (the last {how} during step {step}; runtime_training_restart_limit "
                f"{limit}); the job stops. Look for the cause in {self.run.controller_log} and the Ray worker logs "
                "(memory, a failing node), then launch the job again on this run directory to resume from its "
                "newest checkpoint"
            ) from exc
        started = time.monotonic()
        was_lost = self._training_state_lost  # a restart for a lost node may have failed before this error
        self._training_state_lost = True  # until a checkpoint is loaded, the pool's state is not the loop's
        cost = restart(exc)
        if cost is None:
            self._training_state_lost = was_lost
            return False
        self.training_restarts += 1
        self._restarts_in_a_row += 1
        self.events.emit("train_worker_lost", f"a training worker {how} during step {step}; the training pool was "
                         f"started again ({self.training_restarts} time(s) in this session)", step=step, how=how,
                         restarts=self.training_restarts, restart_s=cost.get("switch_s"))
        self._back_to_checkpoint(step, f"a training worker {how} during step {step}", started)
        return True

    def _replanned_onto_capacity(self) -> bool:
        """At a step boundary: when the cluster lost GPUs, the pools are re-planned onto what remains; True when
        the training pool was restarted for it (the loop then goes back to the newest checkpoint)."""
        replan = self.session.replan_onto_capacity
        if replan is None:
            return False
        step, started = self.state.step + 1, time.monotonic()
        outcome = replan()
        if outcome is None or not outcome.get("training_restarted"):
            return False
        self._training_state_lost = True  # the new ranks hold the initial weights until the checkpoint loads
        self._back_to_checkpoint(step, f"the cluster lost GPUs before step {step}", started)
        return True

    def _back_to_checkpoint(self, step: int, after: str, started: float) -> None:
        """After the training pool was restarted (its ranks hold the initial weights): the step in flight is
        abandoned (its evaluation and generation go, samples are drawn again) and the loop continues from the
        newest complete checkpoint with a new producer."""
        self._settle_pending_evaluation()
        self._settle_pending_publish()
        self.stop_producer()
        self.reporter.set_state("starting", step=self.state.step, message="restarting the training pool")
        self._load_newest(True, after=after)
        self._training_state_lost = False
        self._make_producer()
        self._align_rollout_weights(self.state.step)
        self.events.emit("train_recovered", f"continuing from step {self.state.step} after {after}",
                         step=self.state.step, lost_step=step, steps_repeated=max(0, step - 1 - self.state.step),
                         seconds=round(time.monotonic() - started, 3))
        self.reporter.set_state("running", step=self.state.step)

    def _on_hold(self, holding: bool) -> None:
        reason = self.gate.reason if self.gate is not None else ""
        if holding:
            self.reporter.set_state("paused", step=self.state.step, message=reason or "paused by the operator")
            self.events.emit("paused", f"holding before step {self.state.step + 1}", step=self.state.step)
        else:
            self.reporter.set_state("running", step=self.state.step)
            self.events.emit("resumed_loop", f"continuing with step {self.state.step + 1}", step=self.state.step)

    def _one_step(self) -> dict[str, Any]:
        from libra.training.spec import TrainSample

        cfg = self.cfg
        assert self.buffer is not None and self.producer is not None
        index = self.state.step  # 0-based index of this step = the policy version it trains
        number = self._step_in_flight = index + 1
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
            behind = self._publish_behind_the_loop
            t = time.monotonic()
            evaluation = {} if behind else self._take_pending_evaluation()
            eval_wait = time.monotonic() - t
            samples = build_samples(groups, cfg.algorithm.advantage_norm_mode, TrainSample)
            t = time.monotonic()
            train_metrics = self._train_step(samples, number)
            times["train"] = time.monotonic() - t
            if behind:
                t = time.monotonic()
                evaluation = self._take_pending_evaluation()
                eval_wait = time.monotonic() - t
            self.state.step = number
            self.prompt_ledger.done([g.index for g in groups] + stats.discarded_indices)
            self.state.prompts_drawn = self.prompt_ledger.position
            self.state.prompts_done_ahead = sorted(self.prompt_ledger.done_ahead)
            self.state.discarded_groups = self.buffer.discarded_groups
            self.state.discarded_samples = self.buffer.discarded_samples
            self.state.rollout_failures = self.producer.failures
            t = time.monotonic()
            sync = self._finish_publish()  # the reload started at an earlier step, when it ran behind the loop
            if number % cfg.sync_interval == 0 and number < self.end_step:
                reason = f"sync_interval {cfg.sync_interval}"
                if behind:
                    sync["export_s"] = self._start_publish(number, reason)
                else:
                    sync = self.publish(number, reason)
            times["sync"] = time.monotonic() - t
            t = time.monotonic()
            if cfg.task.eval_interval and (number % cfg.task.eval_interval == 0 or number == self.end_step):
                if number == self.end_step:
                    evaluation = self._record_evaluation(number, self._run_evaluation(number))
                else:
                    self._start_evaluation(number)
            times["eval"] = eval_wait + time.monotonic() - t
            t = time.monotonic()
            if cfg.checkpoint.interval_steps and number % cfg.checkpoint.interval_steps == 0:
                self._save_checkpoint_files()  # marked complete once the step's metrics row is written
            times["checkpoint"] = time.monotonic() - t
        for phase, seconds in times.items():
            self.timings[phase] += seconds
        desired = self.session.desired.get()
        row: dict[str, Any] = {"step": number, "wall_time": round(time.time(), 3)}
        row.update(rollout_metrics(groups, index))
        row.update({f"train_{k}": v for k, v in train_metrics.items() if isinstance(v, int | float)})
        row.update({f"time_{k}_s": round(v, 4) for k, v in times.items()})
        row["time_step_s"] = round(time.monotonic() - started, 4)
        train_tokens = float(train_metrics.get("tokens", 0) or 0)
        row["train_tokens_per_s"] = train_tokens / times["train"] if times["train"] > 0 else 0.0
        row.update(
            policy_version=number,
            rollout_version=self.rollout_version,
            discarded_samples=stats.discarded_samples,
            discarded_samples_total=self.buffer.discarded_samples,
            collect_attempts=stats.attempts,
            rollout_instances=desired.rollout_instances,
            rollout_gpus=desired.rollout_gpus,
            train_gpus=desired.train_gpus,
            queue_running=self.buffer.running,
            queue_buffered=self.buffer.buffered,
        )
        row.update({f"eval_{k}": v for k, v in evaluation.items()})
        row.update({f"sync_{k}": v for k, v in sync.items()})
        return row

    def _train_step(self, samples: list[Any], number: int) -> dict[str, float]:
        """The step on the training pool; with elastic hybrid parallelism on (a synchronous job: the lag bound
        0 admits no group of the next step before this step's weights are published, so the rollout pool
        idles now) with borrowed rollout GPUs, given back before the next rollout phase."""
        if self.session.ehp_train_step is not None and self.buffer is not None:
            return self.session.ehp_train_step(samples, number, self.buffer.running)
        return self.session.training.train_step(samples, step=number)

    def _on_collect_timeout(self, attempt: int, have: int) -> None:
        assert self.buffer is not None
        self.events.emit(
            "batch_timeout",
            f"collected {have} of {self.cfg.batch_size} groups; retry {attempt} of "
            f"{self.cfg.global_resource_planner.runtime_batch_collection_max_retries}",
            running=self.buffer.running,
        )
        self.session.wake_reconciler()

    # ---- weights, evaluation, checkpoints -------------------------------------------------------------
    @property
    def _publish_behind_the_loop(self) -> bool:
        """Whether the rollout servers reload while the loop goes on (see the module docstring)."""
        return self.cfg.max_head_offpolicyness >= 1 and self.session.ehp_train_step is None

    def publish(self, version: int, reason: str) -> dict[str, Any]:
        """Export the trainer's weights and reload every rollout instance with them (validated ACKs)."""
        started = time.monotonic()
        out, checksum = self._export(version)
        return self._reload(version, reason, out, checksum, started)

    def _export(self, version: int) -> tuple[Path, str]:
        """The training ranks write the weights of `version` as an HF folder; its checksum. A full run directory
        stops the job with a `DiskFullError` (no checkpoint is tried after it: it would meet the same disk)."""
        out = self.run.weights_dir(version)
        # traced by the pools: weight_sync.export on the training ranks, weight_sync.publish (the flow source
        # of the instances' reloads) by the rollout pool on this process's tracer
        try:
            return out, self.session.training.export_hf(str(out))
        except Exception as exc:
            lost = self.session.training_loss
            if lost is not None and lost(exc):  # a worker died or hung: the training pool's recovery, not the disk
                raise
            full = weights_disk_full_error(self.store, version, exc)
            if full is None:
                raise
            self._disk_full = True
            raise full from exc

    def _reload(self, version: int, reason: str, out: Path, checksum: str, started: float) -> dict[str, Any]:
        """Every rollout instance loads the exported weights (validated ACKs); the publish's figures."""
        publish_version = version + self.session.desired.get().rollout_version_offset
        # through the controller's weight gate: no rollout membership change runs during a publish
        report = self.session.publish_weights(publish_version, str(out), checksum)
        seconds = time.monotonic() - started
        self._mark_rollout_version(version)
        self.run.prune_weights(keep={version})
        details = report_fields(report)
        self.events.emit("weight_sync", reason, version=version, seconds=round(seconds, 3), **details)
        return {"total_s": round(seconds, 4), "version": version, **details}

    def _start_publish(self, version: int, reason: str) -> float:
        """Export now (the training ranks hold this step's weights until the next step changes them) and reload
        the rollout servers on the publish thread; the export's seconds. The previous reload has finished
        (`_finish_publish`), so no two publishes overlap and pruning never meets a folder being loaded."""
        assert self._pending_publish is None, "a publish is still running"
        started = time.monotonic()
        out, checksum = self._export(version)
        export_s = round(time.monotonic() - started, 4)
        if self._publisher is None:
            self._publisher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="libra-publish")
        self._pending_publish = (version, self._publisher.submit(self._reload, version, reason, out, checksum, started))
        return export_s

    def _finish_publish(self) -> dict[str, Any]:
        """Wait for the reload running behind the loop (if any); its figures. Its error is raised here, as a
        publish in the foreground raises it."""
        if self._pending_publish is None:
            return {}
        _, future = self._pending_publish
        self._pending_publish = None
        return future.result()

    def _settle_pending_publish(self) -> None:
        """When the loop ends or goes back to a checkpoint: let a reload still running finish (the servers then
        serve the newest published weights) and stop the publish thread; an error only reaches the event log
        (a resume brings the servers to its checkpoint's weights)."""
        version = self._pending_publish[0] if self._pending_publish is not None else None
        try:
            self._finish_publish()
        except Exception as exc:
            self.events.emit("warning", f"weight publish of step {version} failed: {type(exc).__name__}: {exc}",
                             step=version)
        if self._publisher is not None:
            self._publisher.shutdown(wait=True)
            self._publisher = None

    def _mark_rollout_version(self, version: int) -> None:
        assert self.buffer is not None
        self.rollout_version = version
        self.buffer.set_rollout_version(version)
        self.session.desired.update(weight_version=version)

    def _start_evaluation(self, number: int) -> None:
        """Evaluate policy `number` on a helper thread while the loop goes on to the next step."""
        self._take_pending_evaluation()
        if self._eval_runner is None:
            self._eval_runner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="libra-eval")
        pending = self._pending_publish
        publish = pending[1] if pending is not None and pending[0] == number else None
        self._pending_eval = (number, self._eval_runner.submit(self._evaluate_when_served, number, publish))

    def _evaluate_when_served(self, number: int,
                              publish: concurrent.futures.Future[dict[str, Any]] | None) -> dict[str, float]:
        """Evaluate policy `number` once the publish of its weights (running behind the loop) has its ACKs; a
        failed publish fails the evaluation (and the loop, when it waits for that publish)."""
        if publish is not None:
            publish.result()
        return self._run_evaluation(number)

    def _take_pending_evaluation(self) -> dict[str, float]:
        """The result of the evaluation started at the previous step (waiting for it), as row fields."""
        if self._pending_eval is None:
            return {}
        number, future = self._pending_eval
        self._pending_eval = None
        try:
            result = future.result(timeout=600.0)
        except Exception as exc:
            self.events.emit("warning", f"evaluation of step {number} failed: {type(exc).__name__}: {exc}",
                             step=number)
            return {}
        return self._record_evaluation(number, result)

    def _settle_pending_evaluation(self) -> None:
        """When the loop ends: finish an evaluation still running (its figures then reach the event log
        only) and stop the helper thread."""
        self._take_pending_evaluation()
        if self._eval_runner is not None:
            self._eval_runner.shutdown(wait=True)
            self._eval_runner = None

    def _record_evaluation(self, number: int, result: dict[str, float]) -> dict[str, float]:
        if self.state.best_eval_accuracy is None or result["accuracy"] > self.state.best_eval_accuracy:
            self.state.best_eval_accuracy = result["accuracy"]
        self.events.emit("eval", f"accuracy {result['accuracy']:.3f} on {int(result['num_prompts'])} prompts",
                         step=number, **result)
        return {**result, "step": number}

    def _run_evaluation(self, number: int) -> dict[str, float]:
        from libra.data import evaluate

        cfg, producer, pool = self.cfg, self.producer, self.session.generation
        assert producer is not None

        async def generate_all(prompts: Sequence[Any]) -> list[tuple[list[int], str]]:
            outs = await asyncio.gather(*(
                pool.generate(list(p.token_ids), n=1, max_new_tokens=cfg.max_new_tokens, temperature=0.0,
                              top_p=1.0, seed=cfg.seed)
                for p in prompts
            ))
            return [(list(o[0].token_ids), self.tokenizer.decode(list(o[0].token_ids), skip_special_tokens=True))
                    for o in outs]

        def generate_fn(prompts: list[Any]) -> list[tuple[list[int], str]]:
            return list(producer.run_coroutine(generate_all(prompts), timeout=600.0))

        with get_tracer().span("eval", step=number):
            return evaluate(generate_fn, self.task, n=cfg.task.eval_size)

    def checkpoint(self) -> None:
        """Save the training pool's checkpoint of the current step, then the controller state (last)."""
        self._save_checkpoint_files()
        self._commit_saved_checkpoint()

    def _save_checkpoint_files(self) -> None:
        """Write the training pool's checkpoint of the current step, not yet complete: a step's checkpoint is
        marked complete (its controller state written) only after the step's metrics row, so a controller that
        dies in between resumes from the checkpoint before and trains the step again, and no step that a
        checkpoint holds is without its row."""
        step = self.state.step
        if step == self._last_checkpoint_step:
            return
        try:
            with get_tracer().span("checkpoint.save", step=step):
                target = self.store.begin(step)
                self.session.training.save_checkpoint(str(target), step)
        except Exception as exc:
            self._raise_disk_full_or(exc, step)
        self._saved_checkpoint_step = step

    def _commit_saved_checkpoint(self) -> None:
        """Mark the checkpoint written by `_save_checkpoint_files` complete; nothing when none waits."""
        step = self._saved_checkpoint_step
        if step is None:
            return
        self._saved_checkpoint_step = None
        if step != self.state.step:  # the loop went back to an earlier checkpoint: the files are not this state's
            return
        if self.reporter.rows_pending:  # a checkpoint never holds a step whose metrics row is not on disk
            self.events.emit("checkpoint_skipped", f"step {step} not saved: {self.reporter.rows_pending} metric "
                             "row(s) could not be written yet (a full disk?); a later checkpoint holds it",
                             step=step)
            return
        try:
            snapshot = ControllerState.from_dict(self.state.to_dict())
            if self._loop_started is not None:
                snapshot.train_seconds += time.monotonic() - self._loop_started
            folder = self.store.commit(snapshot)
        except Exception as exc:
            self._raise_disk_full_or(exc, step)
        self._last_checkpoint_step = step
        self._restarts_in_a_row = 0
        self.events.emit("checkpoint", f"saved step {step}", step=step, path=str(folder))
        if self.mirror is not None:
            self.mirror.submit(step, folder)

    def _raise_disk_full_or(self, exc: Exception, step: int) -> NoReturn:
        full = disk_full_error(self.store, step, exc)
        if full is None:
            raise exc
        self._disk_full = True
        raise full from exc

    def final_checkpoint(self) -> None:
        if self._training_state_lost or self._disk_full:  # the pool lost its state / a save cannot be written
            return
        if self.state.step != self._reported_step:
            # the loop stopped between a step's training and its metrics row: a checkpoint of that step would
            # resume after a step without a row, so the job resumes from the checkpoint before and trains it again
            self.events.emit("checkpoint_skipped", f"step {self.state.step} ended without its metrics row; not "
                             f"saved, a resume trains it again", step=self.state.step)
            return
        if self.state.step > 0 and self.state.step != self._last_checkpoint_step:
            self.checkpoint()

    def stop_producer(self) -> None:
        if self.producer is not None:
            self.producer.stop()


def report_fields(report: Any) -> dict[str, Any]:
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
