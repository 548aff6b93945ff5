"""The training pool: `num_gpus` Megatron-Core workers on Ray behind one driver-side handle.

`start` checks the spec against the model (every problem in one error), places the workers, lets rank 0
pick the rendezvous address and builds the model on every rank. Each later call is collective: every rank
gets the same arguments and the pool returns rank 0's answer (all ranks agree on metrics and checksums).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from libra.cluster.ray_runtime import RayRuntime
from libra.cluster.training_workers import TrainingWorkerGroup
from libra.device import cuda_available
from libra.training.hf_arch import read_training_model
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
        self.layout: TrainLayout = check_spec(spec, self.arch, cuda_available())
        self._group: TrainingWorkerGroup | None = None
        self.rank_info: list[dict[str, int]] = []

    @property
    def group(self) -> TrainingWorkerGroup:
        if self._group is None:
            raise RuntimeError(f"training pool '{self.name}' is not started; call start() first")
        return self._group

    def start(self) -> None:
        """Place the workers, form the process group and load the HF weights into Megatron on every rank."""
        t0 = time.perf_counter()
        group = TrainingWorkerGroup(self.runtime, TrainingWorker, (self.spec,), self.spec.num_gpus, self.name)
        self._group = group
        try:
            group.start()
            addr = group.rendezvous_host()
            port = group.call_rank(0, "rendezvous_port", addr, timeout=self.spec.call_timeout_s)
            self.rank_info = group.call("setup", addr, port, timeout=self.spec.call_timeout_s)
            group.call("start_checkpoint_writer_warm_up", timeout=self.spec.call_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        log.info("training pool %s started: %s in %.1fs", self.name, self.layout.describe(self.spec.num_gpus), time.perf_counter() - t0)

    def train_step(self, samples: list[TrainSample], step: int) -> dict[str, float]:
        """One GRPO optimizer step on `samples`; metrics: loss, clip_frac, kl, entropy, grad_norm,
        logprob_gap, tokens (+ dual_clip_frac, is_kept_frac, lr, timings)."""
        t0 = time.perf_counter()
        metrics = self.group.call("train_step", list(samples), step, timeout=self.spec.call_timeout_s)[0]
        metrics["time_step_s"] = time.perf_counter() - t0
        return metrics

    def export_hf(self, out_dir: str) -> str:
        """Write the current weights as an HF checkpoint (safetensors + config/tokenizer); returns its checksum."""
        return str(self.group.call("export_hf", out_dir, timeout=self.spec.call_timeout_s)[0])

    def save_checkpoint(self, ckpt_dir: str, step: int) -> str:
        return str(self.group.call("save_checkpoint", ckpt_dir, step, timeout=self.spec.call_timeout_s)[0])

    def load_checkpoint(self, ckpt_dir: str) -> int:
        """Resume from `ckpt_dir` (a root with `latest` or one step directory), whatever layout wrote it."""
        return int(self.group.call("load_checkpoint", ckpt_dir, timeout=self.spec.call_timeout_s)[0])

    def recompute_probe(self, seq_len: int, micro_batch_size: int = 0) -> dict[str, int]:
        """Peak bytes of one log-prob recomputation micro batch of `seq_len` tokens (the largest over ranks);
        `micro_batch_size` defaults to the spec's recompute_micro_batch_size."""
        results = self.group.call("recompute_probe", seq_len, micro_batch_size, timeout=self.spec.call_timeout_s)
        return max(results, key=lambda r: r["peak_bytes"])

    def compute_logprobs(self, samples: list[TrainSample], reference: bool = False) -> list[list[float]]:
        """The current (or reference) model's log-prob of every response token, per sample."""
        parts = self.group.call("compute_logprobs", list(samples), reference, timeout=self.spec.call_timeout_s)
        out: list[list[float]] = [[] for _ in samples]
        for part in parts:
            if part is None:
                continue
            for i, values in enumerate(part["logprobs"]):
                out[part["start"] + i] = values
        return out

    def forward_logits(self, token_ids: list[list[int]]) -> list[list[list[float]]]:
        """Full-vocabulary logits `[batch][position][vocab]` of equal-length token sequences."""
        results = self.group.call("forward_logits", token_ids, timeout=self.spec.call_timeout_s)
        found = [r for r in results if r is not None]
        if len(found) != 1:
            raise RuntimeError(f"expected logits from exactly one rank, got {len(found)}")
        return found[0]

    def shutdown(self) -> None:
        """Tear down the process groups (best effort) and stop every worker."""
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

    def __enter__(self) -> TrainingPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
