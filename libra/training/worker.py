"""One training process: Megatron-Core model chunks, optimizer, reference model, and the step / export /
checkpoint entry points the pool calls on every rank (each call is collective across the pool).

The class is plain Python: `libra/cluster/training_workers.py` runs it as a Ray actor, and a single
process can use it directly (world size 1). Every entry point runs inside `cpu_compat.device_scope()`.

Each rank writes its phase trace (`phase_trace_rank{1000 + rank}.jsonl`) when the spec carries enabled
`TraceSettings`: the phases of a step (`train.*`), the HF export (`weight_sync.export`) and checkpoint I/O.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from libra.algo.grpo import LossInputs, grpo_loss_sums
from libra.device import cuda_available, dist_backend, torch_device
from libra.metering.holder import GpuHolderSlice
from libra.observability.phase_trace import PhaseTracer, now_ns
from libra.observability.trace_schema import rank_for
from libra.training import batching, checkpoint, child_processes, cpu_compat, export, megatron_setup
from libra.training.batching import StepBatch
from libra.training.convert import HFWeightReader, ParamMapping, chunk_mappings, load_chunk_from_hf
from libra.training.hf_arch import padded_vocab_size, read_training_model
from libra.training.logprobs import vocab_parallel_logprobs
from libra.training.pipeline import forward_full_logits, forward_logprobs, is_last_stage, run_schedule
from libra.training.spec import TrainingPoolSpec, TrainSample, check_spec
from planner.layout import TrainLayout
from planner.model_spec import ModelSpec

log = logging.getLogger(__name__)

METRIC_ORDER = (
    "loss_num", "units", "clip_count", "dual_clip_count", "kl_sum", "entropy_sum", "gap_sum", "tokens", "is_kept"
)


def open_rank_tracer(spec: TrainingPoolSpec, rank: int) -> PhaseTracer:
    """The phase tracer of training rank `rank`: off unless `spec.trace` is enabled. A rank outside the
    trace rank block is not traced (with a warning) rather than failing the pool."""
    if spec.trace is None or not spec.trace.enabled:
        return PhaseTracer.disabled("train", 0)
    try:
        trace_rank = rank_for("train", rank)
    except ValueError as exc:
        log.warning("training rank %d writes no phase trace: %s", rank, exc)
        return PhaseTracer.disabled("train", 0)
    return PhaseTracer.from_settings(spec.trace, role="train", rank=trace_rank)


# The rendezvous port is picked here and bound later by init_process_group. A port from the kernel's
# ephemeral range (bind to port 0) can be taken in between by any outgoing connection's local port (Ray's and
# vLLM's clients open many); below that range only explicit binds compete.
RENDEZVOUS_PORTS = range(20000, 32768)


def free_port(host: str = "127.0.0.1", ports: range = RENDEZVOUS_PORTS, tries: int = 64) -> int:
    """A port of `ports` that `host` can bind now (a random one; the ephemeral range when none of `tries`
    binds)."""
    # SystemRandom: a training process seeds `random`, and two pools must not draw the same ports
    for port in random.SystemRandom().sample(ports, min(tries, len(ports))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class TrainingWorker:
    """Rank `rank` of a training pool of `world_size` processes.

    Besides the collective calls the pool makes (`setup`, `train_step`, `export_hf`, checkpoints), a step's parts
    are public for the steps shared with borrowed replicas (`libra.training.ehp_steps`): `local_batch`,
    `logprob_pass`, `forward_backward`, `optimizer_step`, `step_metrics` and `unwrapped_chunks`."""

    def __init__(self, spec: TrainingPoolSpec, rank: int, world_size: int) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.arch: ModelSpec = read_training_model(spec.model_path)
        self.layout: TrainLayout = check_spec(spec, self.arch, cuda_available())
        if spec.num_gpus != world_size:
            raise ValueError(f"spec.num_gpus={spec.num_gpus} but the pool started {world_size} workers")
        self.chunks: list[Any] = []  # DDP-wrapped GPTModel chunks
        self.ref_chunks: list[Any] = []
        self.mappings: list[list[ParamMapping]] = []
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.step = 0
        self.tracer = open_rank_tracer(spec, rank)
        self._reach_listener: Any = None  # the reachability check's listener (`reach_listen`)
        self._cpu = GpuHolderSlice(spec.metering, f"train-{rank}")
        # a checkpoint writer forked from this process must not outlive it: Ray would not see the worker die
        child_processes.install_for_forks()

    # ---- set-up ------------------------------------------------------------------------------------
    def rendezvous_port(self, host: str) -> int:
        """A free port on `host` for the process-group rendezvous (asked of rank 0)."""
        return free_port(host)

    def reach_listen(self) -> tuple[str, int]:
        """Listen on this node's address for the pool's reachability check (`reach_close` ends it)."""
        from libra.cluster.reachability import Listener
        from libra.cluster.rollout_hosts import node_ip_address

        self._reach_listener = Listener(node_ip_address())
        return self._reach_listener.address

    def reach_check(self, peers: list[tuple[str, int]]) -> list[str]:
        """For each peer listener (host, port): '' when a connection opened, else why not."""
        from libra.cluster.reachability import unreachable

        return unreachable([(str(host), int(port)) for host, port in peers])

    def reach_close(self) -> None:
        listener, self._reach_listener = self._reach_listener, None
        if listener is not None:
            listener.close()

    def setup(self, master_addr: str, master_port: int) -> dict[str, int]:
        """Join the process group, build Megatron parallel state, the model (loaded from HF) and optimizer."""
        self._cpu.hold(os.getpid())  # metered logical GPUs: this worker and what it starts run in its CPU slice
        with cpu_compat.device_scope():
            if cuda_available():
                torch.cuda.set_device(0)
            dist.init_process_group(
                backend=dist_backend(),
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(minutes=30),
            )
            return self._build()

    def _build(self) -> dict[str, int]:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        megatron_setup.initialize_parallel_state(self.layout)
        torch.manual_seed(self.spec.seed)
        model_parallel_cuda_manual_seed(self.spec.seed)
        config = megatron_setup.build_transformer_config(self.arch, self.spec, self.layout, cuda_available())
        # perform_initialization stays on although every parameter is overwritten from HF: with CPU
        # initialization megatron-core 0.16.1 sets the tensor-parallel attributes (used by the grad norm)
        # only inside the initialization routine.
        raw = megatron_setup.build_model_chunks(self.arch, config, self.layout)
        reader = HFWeightReader(self.spec.model_path)
        self.mappings = [self._chunk_mappings(c, i) for i, c in enumerate(raw)]
        tp_rank, tp = ps.get_tensor_model_parallel_rank(), self.layout.tp
        for chunk, mappings in zip(raw, self.mappings, strict=True):
            load_chunk_from_hf(chunk, mappings, reader, self.arch, tp_rank, tp)
        self.chunks = megatron_setup.wrap_ddp(raw, config, self.spec)
        self.optimizer, self.scheduler = megatron_setup.build_optimizer(self.chunks, self.spec)
        config.finalize_model_grads_func = finalize_model_grads
        if self.spec.params_dtype != "fp32":
            config.grad_scale_func = self.optimizer.scale_loss
        if self.spec.algorithm.ref_kl.enable:
            self.ref_chunks = megatron_setup.build_model_chunks(self.arch, config, self.layout)
            for chunk, mappings in zip(self.ref_chunks, self.mappings, strict=True):
                load_chunk_from_hf(chunk, mappings, reader, self.arch, tp_rank, tp)
                chunk.requires_grad_(False)
        return {
            "rank": self.rank,
            "tp_rank": tp_rank,
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank(),
            "last_stage": int(is_last_stage()),
        }

    def _chunk_mappings(self, chunk: Any, vp_stage: int) -> list[ParamMapping]:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        stage = vp_stage if self.layout.vpp > 1 else None
        offset = get_transformer_layer_offset(chunk.config, vp_stage=stage)
        return chunk_mappings(
            self.arch,
            layer_offset=offset,
            num_local_layers=len(chunk.decoder.layers),
            pre_process=chunk.pre_process,
            post_process=chunk.post_process,
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=self.layout.ep,
        )

    @property
    def unwrapped_chunks(self) -> list[Any]:
        """The model chunks (one per virtual pipeline stage) without their DDP wrappers."""
        return [c.module for c in self.chunks]

    def _dp(self) -> tuple[int, int]:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    # ---- batches -----------------------------------------------------------------------------------
    def local_batch(self, samples: list[TrainSample], *micro_sizes: int) -> tuple[StepBatch, int]:
        """This DP rank's block of `samples`, packed for `micro_sizes`, and the index of its first sample."""
        batching.validate_samples(samples, self.arch.vocab_size, self.arch.max_position_embeddings)
        dp_rank, dp = self._dp()
        start, stop = batching.dp_block(len(samples), dp, dp_rank)
        rows = batching.rows_per_rank(len(samples), dp, *micro_sizes)
        batch = batching.pack(samples[start:stop], rows, self._seq_len(batching.step_seq_len(samples)))
        return batch.to(torch_device()), start

    def _seq_len(self, length: int) -> int:
        """`length` rounded up to what the layout needs (a multiple of TP under sequence parallelism)."""
        multiple = self.layout.tp if megatron_setup.uses_sequence_parallel(self.arch, self.layout) else 1
        return -(-length // multiple) * multiple

    def logprob_pass(self, chunks: list[Any], batch: StepBatch, size: int) -> torch.Tensor | None:
        """Collective: the log-probs `chunks` give `batch` in micro-batches of `size` (None off the last stage)."""
        results = forward_logprobs(chunks, batching.micro_batches(batch, size), self.arch.vocab_size)
        if results is None:
            return None
        return torch.cat([r["logp"] for r in results], dim=0)

    # ---- training ----------------------------------------------------------------------------------
    def train_step(self, samples: list[TrainSample], step: int) -> dict[str, float]:
        """Collective: one optimizer step of GRPO on `samples` (all of them; each DP rank takes its block)."""
        tracer = self.tracer
        with cpu_compat.device_scope(), tracer.span("train.step", step, samples=len(samples)) as step_span:
            spec = self.spec
            mbs, rmbs = spec.micro_batch_size, spec.recompute_micro_batch_size
            batch, _ = self.local_batch(samples, mbs, rmbs)
            old_logp: torch.Tensor | None = batch.rollout_logp
            t0, c0 = time.perf_counter(), time.process_time()
            if spec.recompute_logprobs:
                with tracer.span("train.recompute_logprobs", step, model="policy"):
                    old_logp = self.logprob_pass(self.chunks, batch, rmbs)
            ref_logp = None
            if spec.algorithm.ref_kl.enable:
                with tracer.span("train.recompute_logprobs", step, model="reference"):
                    ref_logp = self.logprob_pass(self.ref_chunks, batch, rmbs)
            t1, c1 = time.perf_counter(), time.process_time()
            with tracer.span("train.forward_backward", step):
                sums = self.forward_backward(batch, old_logp, ref_logp)
            with tracer.span("train.optimizer", step):
                grad_norm = self.optimizer_step()
            t2, c2 = time.perf_counter(), time.process_time()
            self.step = step
            # CPU seconds beside wall seconds: on metered logical GPUs the gap is time spent waiting for the slice
            metrics = self.step_metrics(sums, grad_norm, recompute_s=t1 - t0, train_s=t2 - t1,
                                        recompute_cpu_s=c1 - c0, train_cpu_s=c2 - c1)
            step_span.set(tokens=int(metrics["tokens"]))
            return metrics

    def forward_backward(
        self, batch: StepBatch, old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None
    ) -> torch.Tensor:
        """Collective: zero the gradients and run forward and backward of the GRPO loss over `batch`; returns
        this rank's metric sums (`METRIC_ORDER`). The optimizer is not stepped."""
        spec = self.spec
        mbs = spec.micro_batch_size
        algo = spec.algorithm
        use_is = algo.is_correction.enable and spec.recompute_logprobs
        vocab = self.arch.vocab_size
        sums = torch.zeros(len(METRIC_ORDER), dtype=torch.float64, device=torch_device())

        def loss_fn(i: int, mb: StepBatch, logits: torch.Tensor):  # type: ignore[no-untyped-def]
            rows = slice(i * mbs, (i + 1) * mbs)
            logp, entropy = vocab_parallel_logprobs(logits, mb.labels, vocab, with_entropy=True)
            assert old_logp is not None  # set on the last stage, the only one that computes the loss
            inputs = LossInputs(
                logp=logp,
                old_logp=old_logp[rows],
                rollout_logp=mb.rollout_logp,
                advantages=mb.advantages,
                mask=mb.mask,
                entropy=entropy,
                ref_logp=ref_logp[rows] if ref_logp is not None else None,
            )
            num, units, metrics = grpo_loss_sums(inputs, algo, use_is)
            values = [num.detach(), units, *(metrics[k] for k in METRIC_ORDER[2:])]
            sums.add_(torch.stack([v.double() for v in values]))
            return num, units.round().to(torch.int), {}

        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        run_schedule(self.chunks, batching.micro_batches(batch, mbs), loss_fn, forward_only=False)
        return sums

    def optimizer_step(self) -> float:
        """Collective: step the optimizer (and the LR schedule when the step was taken); the gradient norm."""
        ok, grad_norm, _ = self.optimizer.step()
        if grad_norm is None:
            grad_norm = self.optimizer.get_grad_norm()
        if ok:
            self.scheduler.step(increment=1)
        else:
            log.warning("optimizer step skipped (non-finite gradients)")
        return float(grad_norm) if grad_norm is not None else float("nan")

    def step_metrics(self, sums: torch.Tensor, grad_norm: float, **timings: float) -> dict[str, float]:
        """Collective: the step's metrics from every rank's metric `sums` (totalled over PP and DP)."""
        from megatron.core import parallel_state as ps

        total = sums.clone()
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
        dist.all_reduce(total, group=ps.get_data_parallel_group())
        s = dict(zip(METRIC_ORDER, total.tolist(), strict=True))
        tokens = max(s["tokens"], 1.0)
        return {
            "loss": s["loss_num"] / max(s["units"], 1.0),
            "clip_frac": s["clip_count"] / tokens,
            "dual_clip_frac": s["dual_clip_count"] / tokens,
            "kl": s["kl_sum"] / tokens,
            "entropy": s["entropy_sum"] / tokens,
            "logprob_gap": s["gap_sum"] / tokens,
            "is_kept_frac": s["is_kept"] / tokens,
            "grad_norm": grad_norm,
            "tokens": s["tokens"],
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            **{f"time_{k}": v for k, v in timings.items()},
        }

    # ---- inspection ----------------------------------------------------------------------------------
    def compute_logprobs(self, samples: list[TrainSample], reference: bool = False) -> dict[str, Any] | None:
        """Collective: the current (or reference) model's log-prob of every response token of this DP rank's
        samples; returned by the last-stage TP-rank-0 workers as {"start": index, "logprobs": [[...], ...]}."""
        from megatron.core import parallel_state as ps

        with cpu_compat.device_scope():
            chunks = self.ref_chunks if reference else self.chunks
            if reference and not chunks:
                raise ValueError("reference log-probs need algorithm.ref_kl.enable=true")
            rmbs = self.spec.recompute_micro_batch_size
            batch, start = self.local_batch(samples, rmbs)
            logp = self.logprob_pass(chunks, batch, rmbs)
            if logp is None or ps.get_tensor_model_parallel_rank() != 0:
                return None
            out = []
            for r in range(batch.num_real):
                keep = batch.mask[r] > 0
                out.append(logp[r][keep].tolist())
            return {"start": start, "logprobs": out}

    def forward_logits(self, token_ids: list[list[int]]) -> list[list[list[float]]] | None:
        """Collective: full-vocabulary logits of equal-length sequences (returned by the last-stage TP-rank-0
        worker of DP replica 0); every DP replica computes the same, which tests exercise."""
        from megatron.core import parallel_state as ps

        with cpu_compat.device_scope():
            given = torch.tensor(token_ids, dtype=torch.long)
            rows, length = given.shape
            seq = self._seq_len(length)
            tokens = torch.full((rows, seq), batching.PAD_ID, dtype=torch.long)
            tokens[:, :length] = given
            batch = StepBatch(
                tokens=tokens,
                positions=torch.arange(seq).unsqueeze(0).expand(rows, -1).contiguous(),
                labels=torch.zeros_like(tokens),
                mask=torch.zeros((rows, seq)),
                rollout_logp=torch.zeros((rows, seq)),
                advantages=torch.zeros(rows),
                num_real=rows,
            ).to(torch_device())
            logits = forward_full_logits(self.chunks, batch)
            if logits is None or ps.get_tensor_model_parallel_rank() != 0 or ps.get_data_parallel_rank() != 0:
                return None
            return logits[:, :length, : self.arch.vocab_size].tolist()

    def recompute_probe(self, seq_len: int, micro_batch_size: int = 0) -> dict[str, int]:
        """Collective: peak bytes of one log-prob recomputation micro batch of `seq_len` tokens
        (`micro_batch_size` rows, default the spec's recompute_micro_batch_size)."""
        from libra.training.memory_probe import measure_peak

        with cpu_compat.device_scope():
            rmbs = micro_batch_size or self.spec.recompute_micro_batch_size
            seq_len = self._seq_len(seq_len)
            tokens = torch.randint(4, self.arch.vocab_size, (rmbs, seq_len), generator=torch.Generator().manual_seed(0))
            batch = StepBatch(
                tokens=tokens,
                positions=torch.arange(seq_len).unsqueeze(0).expand(rmbs, -1).contiguous(),
                labels=torch.roll(tokens, -1, dims=1),
                mask=torch.ones((rmbs, seq_len)),
                rollout_logp=torch.zeros((rmbs, seq_len)),
                advantages=torch.zeros(rmbs),
                num_real=rmbs,
            ).to(torch_device())
            result = measure_peak(
                lambda: forward_logprobs(self.unwrapped_chunks, [batch], self.arch.vocab_size), modules=self.unwrapped_chunks
            )
            result.update(micro_batch_size=rmbs, seq_len=seq_len, rank=self.rank)
            return result

    # ---- elastic hybrid parallelism ------------------------------------------------------------------
    def ehp(self, op: str, *args: Any) -> Any:
        """One operation of a step shared with borrowed replicas (`libra.training.ehp_steps.OPS`)."""
        from libra.training import ehp_steps

        return ehp_steps.run(self, op, *args)

    # ---- weights and checkpoints ---------------------------------------------------------------------
    def export_hf(self, out_dir: str) -> str:
        """Collective: write the HF checkpoint; rank 0 returns its checksum, the others ''."""
        with cpu_compat.device_scope(), self.tracer.span("weight_sync.export", self.step, path=out_dir):
            pairs = list(zip(self.unwrapped_chunks, self.mappings, strict=True))
            dtype = megatron_setup.DTYPES[self.spec.params_dtype]
            export.export(out_dir, pairs, self.arch, self.spec.model_path, dtype)
            if self.rank != 0:
                return ""
            from libra.rollout.weights_checksum import checksum_hf_weights

            return checksum_hf_weights(out_dir)

    def save_checkpoint(self, ckpt_dir: str, step: int) -> str:
        with cpu_compat.device_scope(), self.tracer.span("checkpoint.save", step, path=ckpt_dir):
            retention = self.spec.retention
            return checkpoint.save(
                ckpt_dir, step, self.unwrapped_chunks, self.optimizer, self.scheduler, self.layout.dims(self.world_size),
                {"model_path": self.spec.model_path, "seed": self.spec.seed},
                retention.keep_last, retention.keep_every,
            )

    def load_checkpoint(self, ckpt_dir: str) -> int:
        start = now_ns()
        try:
            with cpu_compat.device_scope():
                step, _ = checkpoint.load(
                    ckpt_dir, self.unwrapped_chunks, self.optimizer, self.scheduler, self.layout.dims(self.world_size),
                    self.spec.seed,
                )
        except BaseException as exc:
            self.tracer.record("checkpoint.load", start, now_ns(), path=ckpt_dir, error=type(exc).__name__)
            raise
        # recorded afterwards: the step is known only once the checkpoint is read
        self.tracer.record("checkpoint.load", start, now_ns(), step=step, path=ckpt_dir)
        self.step = step
        return step

    def process_id(self) -> int:
        return os.getpid()

    def padded_vocab(self) -> int:
        return padded_vocab_size(self.arch.vocab_size, self.layout.tp)

    def shutdown(self) -> None:
        """Tear down the process groups and write out this rank's remaining trace records."""
        try:
            with cpu_compat.device_scope():
                from megatron.core import parallel_state as ps

                if ps.model_parallel_is_initialized():
                    ps.destroy_model_parallel()
                if dist.is_initialized():
                    dist.destroy_process_group()
        finally:
            self.tracer.close()
            self._cpu.release()
