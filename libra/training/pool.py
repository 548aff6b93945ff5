"""The training pool: `num_gpus` Megatron-Core workers on Ray behind one driver-side handle.

`start` checks the spec against the model (every problem in one error), places the workers, lets rank 0
pick the rendezvous address and builds the model on every rank. Each later call is collective: every rank
gets the same arguments and the pool returns rank 0's answer (all ranks agree on metrics and checksums).

`relayout` moves the pool to another GPU count and/or layout at a step boundary (checkpoint path, see
`libra.training.resize`). Every entry point takes the pool's lock, so a relayout asked for while a step runs
waits for the step to end, and the next step waits for the relayout: the caller never sees a half-moved
pool. The handle keeps its identity across a relayout (the RL loop holds it).

`replace_workers` starts the pool again at the same spec after one of its processes died (a call then fails
with `libra.cluster.training_workers.WorkerLostError`) or hung: every collective call runs under a deadline
from the pool's hang rule (`libra.training.call_deadlines`), and one that outlives it fails with
`WorkerHungError`, a kind of lost worker.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from libra.cluster.ray_runtime import RayRuntime
from libra.cluster.training_workers import TrainingWorkerGroup
from libra.device import pools_on_cuda
from libra.training import checkpoint
from libra.training.call_deadlines import CallDeadlines
from libra.training.hf_arch import read_training_model
from libra.training.resize import ResizeCost, TrainingResizeError
from libra.training.spec import TrainingPoolSpec, TrainSample, check_spec
from libra.training.worker import TrainingWorker
from planner.layout import TrainLayout

log = logging.getLogger(__name__)


class TrainingPool:
    """Driver-side handle of the Megatron-Core training workers."""

    def __init__(self, runtime: RayRuntime, spec: TrainingPoolSpec, name: str = "libra-train") -> None:
        self.runtime = runtime
        self.spec = spec
        self.name = name
        self.arch = read_training_model(spec.model_path)
        self.layout: TrainLayout = check_spec(spec, self.arch, pools_on_cuda())
        self._group: TrainingWorkerGroup | None = None
        self.rank_info: list[dict[str, int]] = []
        self.step = 0  # the last optimizer step taken or loaded
        # the ranks hold the model's initial weights: started, no optimizer step taken, no checkpoint loaded
        self.fresh = True
        # goes up whenever the ranks' weights change (a step, a checkpoint load, a start): a copy of them taken
        # at one version is current while the pool (the same worker group) is still at that version
        self.weights_version = 0
        self.resizes: list[ResizeCost] = []
        # called with each resize's cost once its first step at the new layout has run
        self.on_resize_measured: Callable[[ResizeCost], None] | None = None
        self._unmeasured: ResizeCost | None = None
        self._lock = threading.RLock()
        self.deadlines = CallDeadlines(spec.hang)

    @property
    def group(self) -> TrainingWorkerGroup:
        if self._group is None:
            raise RuntimeError(f"training pool '{self.name}' is not started; call start() first")
        return self._group

    @property
    def running(self) -> bool:
        return self._group is not None

    def start(self) -> None:
        """Place the workers, form the process group and load the HF weights into Megatron on every rank."""
        with self._lock:
            t0 = time.perf_counter()
            self.deadlines.at((self.spec.num_gpus, self.layout))
            group = TrainingWorkerGroup(self.runtime, TrainingWorker, (self.spec,), self.spec.num_gpus, self.name)
            self._group = group
            self.weights_version += 1
            self.rank_info = []  # set once every rank joined the process group
            try:
                group.start()
                group.check_reachability(self.spec.hang.first_call_s)
                addr = group.rendezvous_host()
                port = group.call_rank(0, "rendezvous_port", addr, timeout=self.spec.hang.first_call_s)
                self.rank_info = group.call("setup", addr, port, timeout=self.spec.hang.first_call_s)
            except BaseException:
                self.shutdown()
                raise
            log.info("training pool %s started: %s in %.1fs", self.name, self.layout.describe(self.spec.num_gpus),
                     time.perf_counter() - t0)

    def train_step(self, samples: list[TrainSample], step: int) -> dict[str, float]:
        """One GRPO optimizer step on `samples`; metrics: loss, clip_frac, kl, entropy, grad_norm,
        logprob_gap, tokens (+ dual_clip_frac, is_kept_frac, lr, timings)."""
        with self._lock:
            t0 = time.perf_counter()
            metrics = self._call("train_step", list(samples), step)[0]
            metrics["time_step_s"] = time.perf_counter() - t0
            self.stepped(step)
            if self._unmeasured is not None:
                cost, self._unmeasured = self._unmeasured, None
                cost.first_step_s = round(metrics["time_step_s"], 4)
                if self.on_resize_measured is not None:
                    try:
                        self.on_resize_measured(cost)
                    except Exception:  # a failing listener must not fail the step
                        log.warning("resize cost listener failed", exc_info=True)
            return metrics

    def export_hf(self, out_dir: str) -> str:
        """Write the current weights as an HF checkpoint (safetensors + config/tokenizer); returns its checksum."""
        with self._lock:
            return str(self._call("export_hf", out_dir)[0])

    def save_checkpoint(self, ckpt_dir: str, step: int) -> str:
        with self._lock:
            return str(self._call("save_checkpoint", ckpt_dir, step)[0])

    def load_checkpoint(self, ckpt_dir: str) -> int:
        """Resume from `ckpt_dir` (a root with `latest` or one step directory), whatever layout wrote it."""
        with self._lock:
            self.step = int(self._call("load_checkpoint", ckpt_dir)[0])
            self.fresh = False
            self.weights_version += 1
            return self.step

    def _call(self, method: str, *args: Any) -> list[Any]:
        """A collective call under the hang rule's deadline for `method` (`WorkerHungError` past it); its
        duration becomes the history of the next deadlines."""
        started = time.perf_counter()
        results = self.group.call(method, *args, timeout=self.deadlines.deadline(method))
        self.deadlines.completed(method, time.perf_counter() - started)
        return results

    def stepped(self, step: int) -> None:
        """Record that the ranks took optimizer step `step` (here, or in a step shared with borrowed replicas)."""
        with self._lock:
            self.step = step
            self.fresh = False
            self.weights_version += 1

    # ---- resize -------------------------------------------------------------------------------------
    def spec_for(self, gpus: int, layout: TrainLayout) -> TrainingPoolSpec:
        """This pool's spec at `gpus` GPUs under `layout`, checked against the model (every problem in one
        error) before anything is stopped."""
        spec = dataclasses.replace(self.spec, num_gpus=gpus, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                                   vpp=layout.vpp)
        check_spec(spec, self.arch, pools_on_cuda())
        return spec

    def relayout(self, gpus: int, layout: TrainLayout, checkpoint_root: str,
                 on_phase: Callable[[str], None] | None = None) -> ResizeCost:
        """Move the pool to `gpus` GPUs under `layout` at a step boundary: save (under `checkpoint_root`) ->
        stop the workers -> start them at the new layout -> load, resharded. Model, optimizer, scheduler and
        step continue. A pool that is down after an earlier failed relayout starts from the newest checkpoint
        under `checkpoint_root`, which must be of its last step (else the state of later steps is lost and
        TrainingResizeError says so). A fresh pool (initial weights, no step taken, nothing loaded: e.g. resized
        before the job's first step) has no optimizer state to carry: its ranks start again from the model
        and nothing is saved or loaded. `on_phase(name)` is called as each phase begins.

        Raises TrainingResizeError naming the phase that failed; the workers are then stopped."""
        with self._lock:
            new_spec = self.spec_for(gpus, layout)
            new_layout = check_spec(new_spec, self.arch, pools_on_cuda())
            was_running = self.running
            from_model = self.fresh
            cost = ResizeCost(
                from_gpus=self.spec.num_gpus if was_running else 0,
                from_layout=self.layout.dims(self.spec.num_gpus) if was_running else {},
                to_gpus=gpus, to_layout=new_layout.dims(gpus), step=self.step, checkpoint="",
                recovered=not was_running,
            )
            started = time.perf_counter()
            phase = "save"
            try:
                if was_running:
                    if not from_model:
                        _begin(on_phase, phase)
                        t = time.perf_counter()
                        cost.checkpoint = self.save_checkpoint(checkpoint_root, self.step)
                        cost.save_s = time.perf_counter() - t
                    phase = "stop"
                    _begin(on_phase, phase)
                    t = time.perf_counter()
                    self.shutdown()
                    cost.stop_s = time.perf_counter() - t
                elif not from_model:
                    phase = "resume"
                    cost.checkpoint = self._consistent_checkpoint(checkpoint_root)
                phase = "start"
                _begin(on_phase, phase)
                self.spec, self.layout = new_spec, new_layout
                t = time.perf_counter()
                self.start()
                cost.start_s = time.perf_counter() - t
                if not from_model:
                    phase = "load"
                    _begin(on_phase, phase)
                    t = time.perf_counter()
                    self.load_checkpoint(cost.checkpoint)
                    cost.load_s = time.perf_counter() - t
            except BaseException as exc:
                self.kill()
                raise TrainingResizeError(phase, checkpoint_root, exc) from exc
            cost.switch_s = time.perf_counter() - started
            for name in ("save_s", "stop_s", "start_s", "load_s", "switch_s"):
                setattr(cost, name, round(getattr(cost, name), 4))
            self.resizes.append(cost)
            self._unmeasured = cost
            log.info("training pool %s: %s in %.1fs", self.name, cost.label, cost.switch_s)
            return cost

    def restart(self, checkpoint_dir: str, gpus: int | None = None, layout: TrainLayout | None = None) -> int:
        """Start a stopped pool (at `gpus` GPUs under `layout`, default its current spec) and load
        `checkpoint_dir` (a root or one step); returns the step loaded. How a job resumes after a resize lost
        the in-memory state."""
        with self._lock:
            if self.running:
                raise RuntimeError(f"training pool '{self.name}' is running; restart() is for a stopped pool")
            if gpus is not None or layout is not None:
                self.spec = self.spec_for(gpus or self.spec.num_gpus, layout or self.layout)
                self.layout = check_spec(self.spec, self.arch, pools_on_cuda())
            self.start()
            try:
                return self.load_checkpoint(checkpoint_dir)
            except BaseException:
                self.kill()
                raise

    def replace_workers(self, gpus: int | None = None, layout: TrainLayout | None = None) -> ResizeCost:
        """After a rank's process died: kill every worker at once (the others may be blocked in a collective
        with the dead one) and start a fresh set, at the same spec or at `gpus` GPUs under `layout` (when the
        cluster lost the GPUs of the old one). The new workers hold the model's initial weights until the
        caller loads a checkpoint (`load_checkpoint`). Returns the cost, with the kill as `stop_s` and
        `recovered` set."""
        with self._lock:
            new_spec = self.spec_for(gpus or self.spec.num_gpus, layout or self.layout)
            new_layout = check_spec(new_spec, self.arch, pools_on_cuda())
            cost = ResizeCost(from_gpus=self.spec.num_gpus, from_layout=self.layout.dims(self.spec.num_gpus),
                              to_gpus=new_spec.num_gpus, to_layout=new_layout.dims(new_spec.num_gpus), step=self.step,
                              checkpoint="", recovered=True)
            started = time.perf_counter()
            self.kill()
            cost.stop_s = round(time.perf_counter() - started, 4)
            self.spec, self.layout = new_spec, new_layout
            t = time.perf_counter()
            self.start()
            cost.start_s = round(time.perf_counter() - t, 4)
            cost.switch_s = round(time.perf_counter() - started, 4)
            self.step = 0
            self.fresh = True
            self._unmeasured = None
            log.warning("training pool %s: every worker replaced after a worker was lost, in %.1fs", self.name,
                        cost.switch_s)
            return cost

    def _consistent_checkpoint(self, root: str) -> str:
        ckpt = checkpoint.resolve(root)
        step = int(checkpoint.read_meta(ckpt)["step"])
        if step != self.step:
            raise RuntimeError(f"the newest complete checkpoint under {root} is of step {step}, but the pool had "
                               f"trained to step {self.step}: the state of the later steps is lost; resume the "
                               "job from its checkpoint")
        return ckpt

    def worker_pids(self) -> list[int]:
        """The process id of every rank (tests kill one to check recovery)."""
        with self._lock:
            return [int(p) for p in self.group.call("process_id", timeout=60)]

    def recompute_probe(self, seq_len: int, micro_batch_size: int = 0) -> dict[str, int]:
        """Peak bytes of one log-prob recomputation micro batch of `seq_len` tokens (the largest over ranks);
        `micro_batch_size` defaults to the spec's recompute_micro_batch_size."""
        with self._lock:
            results = self.group.call("recompute_probe", seq_len, micro_batch_size, timeout=self.spec.hang.first_call_s)
        return max(results, key=lambda r: r["peak_bytes"])

    def compute_logprobs(self, samples: list[TrainSample], reference: bool = False) -> list[list[float]]:
        """The current (or reference) model's log-prob of every response token, per sample."""
        with self._lock:
            parts = self._call("compute_logprobs", list(samples), reference)
        out: list[list[float]] = [[] for _ in samples]
        for part in parts:
            if part is None:
                continue
            for i, values in enumerate(part["logprobs"]):
                out[part["start"] + i] = values
        return out

    def forward_logits(self, token_ids: list[list[int]]) -> list[list[list[float]]]:
        """Full-vocabulary logits `[batch][position][vocab]` of equal-length token sequences."""
        with self._lock:
            results = self.group.call("forward_logits", token_ids, timeout=self.spec.hang.first_call_s)
        found = [r for r in results if r is not None]
        if len(found) != 1:
            raise RuntimeError(f"expected logits from exactly one rank, got {len(found)}")
        return found[0]

    def shutdown(self) -> None:
        """Tear down the process groups (best effort) and stop every worker."""
        with self._lock:
            if self._group is None:
                return
            group, self._group = self._group, None
            try:
                if group.actors and self.rank_info:
                    group.call("shutdown", timeout=60)
            except Exception as exc:
                log.warning("training pool %s: clean shutdown failed (%s); killing workers", self.name, exc)
            finally:
                group.shutdown()

    def kill(self) -> None:
        """Stop every worker at once, without the collective tear-down (after a rank died, the others may be
        blocked in a collective and would not answer)."""
        with self._lock:
            group, self._group = self._group, None
            if group is not None:
                group.shutdown()

    def __enter__(self) -> TrainingPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _begin(on_phase: Callable[[str], None] | None, phase: str) -> None:
    if on_phase is not None:
        on_phase(phase)
