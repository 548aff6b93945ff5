"""Elastic hybrid parallelism (EHP), the rank side: what a core or a borrowed training rank runs in a step whose
global batch is shared with borrowed data-parallel replicas. `TrainingWorker.ehp(op, *args)` dispatches here
(`OPS`); `libra/training/ehp.py` drives the operations across both pools.

Why the combined gradient is the fixed pool's. The model config sets `calculate_per_token_loss`, so a rank's
backward leaves the unnormalized sum S_r = sum of d(loss numerator)/d(theta) over its micro batches in the
DDP main-grad buffers and the schedule counts its loss units U_r (on the last pipeline stage); Megatron's DDP
sums the buffers over the DP x CP group (scaling factor 1) and `finalize_model_grads` divides once by the
units summed over DP x CP. A fixed pool's gradient is therefore (sum of S_r) / (sum of U_r) over all its
ranks, however the batch is split. A step with borrowed replicas keeps numerator and units apart to the end:

1. Core and borrowed ranks run forward/backward on their shares with finalization deferred
   (`_deferred_finalize` captures the unit count; the grads stay local sums).
2. A borrowed world sums its grads over its own DP x CP group only (`finish_grad_sync`: the decoupled
   communication domain; a world of one replica has nothing to sum) and its units and metric sums over its
   PP and DP groups. It skips finalize's other reductions (sequence-parallel norms over TP, tied embeddings
   across PP stages): the core runs them once, on the combined sums.
3. The borrowed world's leader ranks (DP x CP rank 0) ship their summed grads (the second result of the same
   call, so a rank's grads exist exactly when its summary does); the core rank of the same (TP, PP) shard on
   the DP rank the driver names adds them into its local buffer (times the ratio of the loss scales, 1
   without fp16), one DP x CP rank of the last stage adds the borrowed units to its count, and the real
   `finalize_model_grads` sums over the core DP group and divides by the global count. Then the usual
   optimizer step; metric sums are combined the same way before `step_metrics` totals them. Every core
   rank's `core_finish` takes the summary of every borrowed rank as an argument, so either every core rank
   finishes or none does (a borrowed rank that failed fails them all before they run): no core rank can be
   left alone in a collective of the finish. The grads travel as references the rank fetches itself, within
   a deadline, and the core ranks agree (one small all-reduce) that every one of them has its share before
   any collective of the finish: grads that cannot reach a core rank (a partition between its node and a
   borrowed one, where the summaries still reach the driver) fail every core rank alike
   (`GRADS_NOT_RECEIVED`), which the driver meets as a borrowed failure, not a hung training pool.

Only the model parameters travel to borrowed ranks (`export_params` / `load_params`): a borrowed rank never
steps its optimizer.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from libra.device import torch_device
from libra.training import cpu_compat
from libra.training.pipeline import is_last_stage
from libra.training.spec import TrainSample

if TYPE_CHECKING:
    from libra.metering.cgroup import CpuCgroup
    from libra.metering.spec import CpuMetering
    from libra.training.worker import TrainingWorker

ChunkTensors = list[dict[str, torch.Tensor]]  # per model chunk: parameter name -> tensor


@dataclass
class PendingStep:
    """A rank's half-finished step: local metric sums and unit count, grads unreduced in the buffers."""

    step: int
    sums: torch.Tensor
    num_tokens: torch.Tensor
    timings: dict[str, float]


_PENDING: weakref.WeakKeyDictionary[Any, PendingStep] = weakref.WeakKeyDictionary()


def _dp_cp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(with_context_parallel=True)


def _model_config(worker: TrainingWorker) -> Any:
    from megatron.core.utils import get_model_config

    return get_model_config(worker.chunks[0])


@contextlib.contextmanager
def _deferred_finalize(worker: TrainingWorker) -> Iterator[dict[str, torch.Tensor]]:
    """Run the schedule without its gradient finalization; yields where the unit count is captured."""
    config = _model_config(worker)
    captured: dict[str, torch.Tensor] = {}
    original = config.finalize_model_grads_func

    def capture(model: Any, num_tokens: torch.Tensor | None, *args: Any, **kwargs: Any) -> None:
        if num_tokens is None:
            raise RuntimeError("elastic hybrid parallelism needs calculate_per_token_loss (a unit count per step)")
        captured["num_tokens"] = num_tokens.detach().clone()

    config.finalize_model_grads_func = capture
    try:
        yield captured
    finally:
        config.finalize_model_grads_func = original


def _local_forward_backward(worker: TrainingWorker, samples: list[TrainSample], step: int) -> PendingStep:
    """Forward/backward of this rank's block of `samples`, as `TrainingWorker.train_step` runs it, with the
    finalization (DP reduction and unit normalization) deferred."""
    spec = worker.spec
    mbs, rmbs = spec.micro_batch_size, spec.recompute_micro_batch_size
    batch, _ = worker.local_batch(samples, mbs, rmbs)
    old_logp: torch.Tensor | None = batch.rollout_logp
    tracer = worker.tracer  # a borrowed rank's is disabled
    t0, c0 = time.perf_counter(), time.process_time()
    if spec.recompute_logprobs:
        with tracer.span("train.recompute_logprobs", step, model="policy", ehp=1):
            old_logp = worker.logprob_pass(worker.chunks, batch, rmbs)
    ref_logp = None
    if spec.algorithm.ref_kl.enable:
        with tracer.span("train.recompute_logprobs", step, model="reference", ehp=1):
            ref_logp = worker.logprob_pass(worker.ref_chunks, batch, rmbs)
    t1, c1 = time.perf_counter(), time.process_time()
    with tracer.span("train.forward_backward", step, ehp=1), _deferred_finalize(worker) as captured:
        sums = worker.forward_backward(batch, old_logp, ref_logp)
    num_tokens = captured.get("num_tokens")
    if num_tokens is None:
        raise RuntimeError("the training schedule did not reach gradient finalization")
    # CPU seconds beside wall seconds: on metered logical GPUs the gap is time spent waiting for the slice
    timings = {"recompute_s": t1 - t0, "forward_backward_s": time.perf_counter() - t1,
               "recompute_cpu_s": c1 - c0, "forward_backward_cpu_s": time.process_time() - c1}
    pending = PendingStep(step, sums, num_tokens, timings)
    _PENDING[worker] = pending
    return pending


def _take_pending(worker: TrainingWorker, step: int) -> PendingStep:
    pending = _PENDING.pop(worker, None)
    if pending is None or pending.step != step:
        found = "none" if pending is None else f"step {pending.step}"
        raise RuntimeError(f"rank {worker.rank}: no forward/backward of step {step} to finish ({found} pending)")
    return pending


def _loss_scale(worker: TrainingWorker) -> float:
    scale = worker.optimizer.get_loss_scale()
    return float(scale.item() if isinstance(scale, torch.Tensor) else scale)


# ---- core ranks --------------------------------------------------------------------------------------
def export_params(worker: TrainingWorker) -> ChunkTensors | None:
    """This rank's model parameters (per chunk, by name) if it is DP x CP rank 0 of its shard, else None."""
    if _dp_cp_rank() != 0:
        return None
    return [{n: p.detach().clone() for n, p in chunk.named_parameters()} for chunk in worker.unwrapped_chunks]


def core_forward_backward(worker: TrainingWorker, samples: list[TrainSample], step: int) -> int:
    """Forward/backward of the core pool's share, finalization deferred; returns this rank's unit count."""
    with cpu_compat.device_scope():
        return int(_local_forward_backward(worker, samples, step).num_tokens.item())


def combine_summaries(world_sizes: list[int], summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The units, metric sums and loss scale of every borrowed world, from the summaries of all their ranks
    (world by world, `world_sizes` ranks each): every rank of a world holds its world's totals, so the first
    one of each counts."""
    if sum(world_sizes) != len(summaries):
        raise RuntimeError(f"{len(summaries)} borrowed summaries for worlds of {world_sizes} ranks")
    heads, start = [], 0
    for size in world_sizes:
        heads.append(summaries[start])
        start += size
    units, sums, scale = 0, [0.0] * len(heads[0]["sums"]) if heads else [], 1.0
    for head in heads:
        units += int(head["units"])
        sums = [a + float(b) for a, b in zip(sums, head["sums"], strict=True)]
        scale = float(head["loss_scale"])
    return {"units": units, "sums": sums, "loss_scale": scale}


GRADS_NOT_RECEIVED = "the borrowed replicas' gradients did not reach every core rank"


def _receive_grads(worker: TrainingWorker, held: tuple[list[Any], ...], timeout_s: float) -> list[Any]:
    """The borrowed gradients this rank adds: `held` are one-element lists of object references (so the call
    started without waiting for them), fetched here within `timeout_s`; then every core rank learns whether
    every one got its share (an all-reduce of one flag over the pool), and all raise `GRADS_NOT_RECEIVED`
    where one did not, before any collective of the finish."""
    from libra.cluster.ehp_workers import fetch_within

    grads, why = fetch_within([box[0] for box in held], timeout_s)
    received = torch.tensor([0 if why else 1], dtype=torch.int32, device=torch_device())
    dist.all_reduce(received, op=dist.ReduceOp.MIN)
    if not int(received.item()):
        said = f"rank {worker.rank} {why}" if why else f"another core rank than {worker.rank} lacks its share"
        raise RuntimeError(f"{GRADS_NOT_RECEIVED} ({said})")
    return grads


def core_finish(worker: TrainingWorker, step: int, export: bool, world_sizes: list[int], grads_timeout_s: float,
                *parts: Any) -> tuple[dict[str, float], ChunkTensors | None]:
    """Add the borrowed replicas' grads, units and metric sums, finalize, step the optimizer; the metrics, and
    (second result) with `export` the stepped parameters this rank exports for the borrowed ranks' next copy
    (`export_params`: None off DP x CP rank 0, or without `export`), so that parking needs no call of its own
    to the core ranks.

    `parts`: the summaries of every borrowed rank (world by world, `world_sizes` ranks each:
    `borrowed_forward_backward`'s first result), then the borrowed gradients this rank adds (its shard), any
    number, each a one-element list holding the reference (`_receive_grads`, within `grads_timeout_s`)."""
    from libra.training.worker import METRIC_ORDER

    count = sum(world_sizes)
    extra = combine_summaries(world_sizes, list(parts[:count]))
    with cpu_compat.device_scope():
        try:
            grads: list[ChunkTensors | None] = _receive_grads(worker, parts[count:], grads_timeout_s)
        except RuntimeError:
            _PENDING.pop(worker, None)
            raise
    with cpu_compat.device_scope(), worker.tracer.span("train.optimizer", step, ehp=1, borrowed_shards=len(grads)):
        pending = _take_pending(worker, step)
        t0 = time.perf_counter()
        scale = _loss_scale(worker) / float(extra.get("loss_scale", 1.0))
        for shard in grads:
            if shard is not None:
                _add_grads(worker, shard, scale)
        num_tokens, sums = pending.num_tokens, pending.sums
        if is_last_stage() and _dp_cp_rank() == 0:
            num_tokens = num_tokens + int(extra.get("units", 0))
        from megatron.core import parallel_state as ps

        if is_last_stage() and ps.get_data_parallel_rank() == 0 and extra.get("sums"):
            sums = sums + torch.tensor(extra["sums"], dtype=sums.dtype, device=sums.device)
        if len(sums) != len(METRIC_ORDER):
            raise RuntimeError(f"metric sums have {len(sums)} entries, expected {len(METRIC_ORDER)}")
        _model_config(worker).finalize_model_grads_func(worker.chunks, num_tokens)
        grad_norm = worker.optimizer_step()
        worker.step = step
        timings = {**pending.timings, "combine_optimizer_s": time.perf_counter() - t0}
        return worker.step_metrics(sums, grad_norm, **timings), export_params(worker) if export else None


def _add_grads(worker: TrainingWorker, shard: ChunkTensors, scale: float) -> None:
    chunks = worker.unwrapped_chunks
    if len(shard) != len(chunks):
        raise RuntimeError(f"rank {worker.rank}: borrowed grads for {len(shard)} model chunks, this rank has {len(chunks)}")
    for chunk, named in zip(chunks, shard, strict=True):
        params = dict(chunk.named_parameters())
        if set(params) != set(named):
            missing = sorted(set(params) ^ set(named))[:3]
            raise RuntimeError(f"rank {worker.rank}: borrowed grads do not match this shard's parameters ({missing})")
        for name, param in params.items():
            param.main_grad.add_(named[name].to(device=param.main_grad.device, dtype=param.main_grad.dtype),
                                 alpha=scale)


# ---- borrowed ranks ----------------------------------------------------------------------------------
def load_params(worker: TrainingWorker, params: ChunkTensors) -> int:
    """Copy the core shard's parameters into this rank's model; returns the number of tensors copied."""
    chunks = worker.unwrapped_chunks
    if len(params) != len(chunks):
        raise RuntimeError(f"rank {worker.rank}: {len(params)} parameter chunks for {len(chunks)} model chunks")
    copied = 0
    with torch.no_grad():
        for chunk, named in zip(chunks, params, strict=True):
            own = dict(chunk.named_parameters())
            if set(own) != set(named):
                raise RuntimeError(f"rank {worker.rank}: the core shard's parameters do not match this rank's")
            for name, param in own.items():
                param.data.copy_(named[name].to(device=param.device, dtype=param.dtype))
                copied += 1
    return copied


def borrowed_forward_backward(worker: TrainingWorker, samples: list[TrainSample], step: int,
                              *after: Any) -> tuple[dict[str, Any], ChunkTensors | None]:
    """Forward/backward of this borrowed world's share, summed over its own DP x CP group (see module
    docstring, step 2). Returns the world's units and metric sums, the loss scale and this rank's shard, and
    (second result) the world-summed grads of this rank's shard if it is a leader (DP x CP rank 0), else None.
    `after`: the results of the calls this one follows (the parameter load, and on metered logical GPUs the move
    back into the lent GPU's CPU slice of a re-attached rank, or None), unused: one that failed fails this call
    before it runs, so a rank never computes on parameters it did not load, nor outside its slice."""
    from megatron.core import parallel_state as ps

    with cpu_compat.device_scope():
        pending = _local_forward_backward(worker, samples, step)
        for chunk in worker.chunks:
            chunk.finish_grad_sync()
        units = pending.num_tokens.to(torch_device()).clone()
        pp_group = ps.get_pipeline_model_parallel_group()
        dist.broadcast(units, src=dist.get_global_rank(pp_group, ps.get_pipeline_model_parallel_world_size() - 1),
                       group=pp_group)
        dist.all_reduce(units, group=ps.get_data_parallel_group(with_context_parallel=True))
        sums = pending.sums.clone()
        dist.all_reduce(sums, group=pp_group)
        dist.all_reduce(sums, group=ps.get_data_parallel_group())
        _take_pending(worker, step)
        summary = {
            "units": int(units.item()),
            "sums": [float(v) for v in sums.tolist()],
            "loss_scale": _loss_scale(worker),
            "leader": _dp_cp_rank() == 0,
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "timings": pending.timings,
        }
        return summary, (_main_grads(worker) if _dp_cp_rank() == 0 else None)


def gradients(worker: TrainingWorker) -> dict[str, Any] | None:
    """Inspection: after a step, the gradient it applied (this shard's main grads, normalized), with the
    shard's (TP, PP) rank, from DP x CP rank 0; None elsewhere. Tests and benchmarks compare pools with it."""
    if _dp_cp_rank() != 0:
        return None
    key = shard_key(worker)
    return {"tp_rank": key[0], "pp_rank": key[1], "grads": _main_grads(worker), "params": export_params(worker)}


def _main_grads(worker: TrainingWorker) -> ChunkTensors:
    """A copy of this rank's main-grad buffers, per model chunk by parameter name."""
    return [{n: p.main_grad.detach().clone() for n, p in chunk.named_parameters()} for chunk in worker.unwrapped_chunks]


def shard_key(worker: TrainingWorker) -> tuple[int, int, int]:
    """(TP rank, PP rank, DP x CP rank) of this rank: which core shard a borrowed rank matches."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), _dp_cp_rank()


def join_lent_slice(worker: TrainingWorker, metering: CpuMetering, holder: str) -> str:
    """Metered logical GPUs: run this borrowed rank, and what it starts, in the CPU slice of the GPU it
    borrows, so it computes on that GPU's share of the CPU (beside the lending server), whether stepping or
    parked. `holder` is the lending rollout instance ("" = a GPU reserved afresh: the rank gets a slice of
    its own; a re-attached rank joins the same one). Returns the slice's name ("" with metering off)."""
    import os

    if not metering.enabled:
        return ""
    if not holder:
        from libra.metering.holder import GpuHolderSlice

        own = getattr(worker, "_ehp_cpu", None)
        if own is None:
            own = GpuHolderSlice(metering, f"borrowed-{worker.rank}-{os.getpid()}")
            worker._ehp_cpu = own  # type: ignore[attr-defined]  # the slice lasts as long as this rank
        piece = own.hold(os.getpid())
        return str(piece.name) if piece is not None else ""
    from libra.metering.cgroup import find_cpu_cgroup

    return join_holder_slice(find_cpu_cgroup(metering.cgroup_root), metering.job, holder, os.getpid())


def leave_lent_slice(worker: TrainingWorker, metering: CpuMetering, holder: str) -> None:
    """Metered logical GPUs: a parked borrowed rank (and what it started) leaves the CPU slice of the rollout
    instance `holder` lending its GPU for the host's share of the CPU, until it joins it again as the first call
    of the next step it is re-attached to. A rank on a GPU of its own ("" holder) keeps its slice."""
    import os

    if not metering.enabled or not holder:
        return
    from libra.metering.cgroup import find_cpu_cgroup
    from libra.metering.slices import CpuSlices

    CpuSlices(find_cpu_cgroup(metering.cgroup_root), metering.job).leave(os.getpid())


def join_holder_slice(cgroup: CpuCgroup, job: str, holder: str, pid: int) -> str:
    """Move `pid` (and its descendants) into the live slice of GPU holder `holder` of job `job`; its name."""
    from libra.metering.slices import CpuSlices, Slice, safe_part

    slices = CpuSlices(cgroup, job)
    live = [n for n in slices.names() if n.holder == safe_part(holder) and n.owner_alive()]
    if not live:
        raise RuntimeError(f"metered logical GPUs: rollout instance {holder!r} has no live CPU slice in job "
                           f"{job!r} (slices: {[str(n) for n in slices.names()]}), so a borrowed rank on its GPU "
                           "cannot be metered; the step trains on the training pool alone")
    name = live[0]
    slices.join(Slice(name, cgroup.path(str(name)), 0.0), pid)
    return str(name)


OPS: dict[str, Callable[..., Any]] = {
    "join_lent_slice": join_lent_slice,
    "leave_lent_slice": leave_lent_slice,
    "export_params": export_params,
    "core_forward_backward": core_forward_backward,
    "core_finish": core_finish,
    "load_params": load_params,
    "borrowed_forward_backward": borrowed_forward_backward,
    "shard_key": shard_key,
    "gradients": gradients,
}


def run(worker: TrainingWorker, op: str, *args: Any) -> Any:
    """Run operation `op` of `OPS` on `worker`."""
    fn = OPS.get(op)
    if fn is None:
        raise ValueError(f"unknown elastic-hybrid operation {op!r}; one of {sorted(OPS)}")
    return fn(worker, *args)
