"""Run micro batches through Megatron's forward/backward schedule (no pipelining, 1F1B or interleaved VPP).

Two uses: a forward-only pass that returns the per-token log-probs of every micro batch (old-policy
recomputation, reference log-probs, parity checks) and the training pass whose loss function is the GRPO
loss. Results exist on the last pipeline stage only; `None` elsewhere.

The loss function returns (numerator, units, metrics) and the model config sets `calculate_per_token_loss`,
so Megatron sums numerators over micro batches, sums gradients over data-parallel ranks and divides once by
the global unit count: the update is the same however the batch is split across micro batches and DP ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from libra.training.batching import StepBatch
from libra.training.logprobs import vocab_parallel_logprobs

LossFn = Callable[[int, StepBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]


def is_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def _schedule_padding(num_batches: int) -> int:
    """Extra all-masked micro batches the interleaved (VPP) schedule needs: it runs micro batches in groups
    of PP, so their number is rounded up to a multiple of PP."""
    from megatron.core import parallel_state

    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if vpp == 1 or num_batches % pp == 0:
        return 0
    return pp - num_batches % pp


def _dummy_loss(output: torch.Tensor):  # type: ignore[no-untyped-def]
    return output.sum() * 0.0, torch.zeros((), dtype=torch.int, device=output.device), {"index": -1}


def run_schedule(
    chunks: list[torch.nn.Module], batches: list[StepBatch], loss_fn: LossFn, forward_only: bool
) -> list[dict[str, Any]]:
    """Run `batches` through `chunks` with Megatron's schedule; returns the loss dicts of the real micro
    batches (last stage; padding micro batches for VPP contribute nothing)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    padded = batches + [_masked(batches[-1])] * _schedule_padding(len(batches))
    index = {id(mb): i for i, mb in enumerate(padded)}

    def forward_step(data_iterator, model):  # type: ignore[no-untyped-def]
        mb = next(data_iterator)
        output = model(mb.tokens, mb.positions, None)
        i = index[id(mb)]
        if i >= len(batches):
            return output, _dummy_loss
        return output, partial(loss_fn, i, mb)

    iterators: Any = [iter(padded) for _ in chunks] if len(chunks) > 1 else iter(padded)
    forward_backward = get_forward_backward_func()
    results = forward_backward(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(padded),
        seq_length=batches[0].seq_len,
        micro_batch_size=batches[0].rows,
        forward_only=forward_only,
    )
    return [r for r in results if r.get("index", 0) != -1]


def _masked(mb: StepBatch) -> StepBatch:
    return StepBatch(
        tokens=mb.tokens, positions=mb.positions, labels=mb.labels, mask=torch.zeros_like(mb.mask),
        rollout_logp=mb.rollout_logp, advantages=torch.zeros_like(mb.advantages), num_real=0,
    )


def forward_logprobs(
    chunks: list[torch.nn.Module], batches: list[StepBatch], vocab_size: int, with_entropy: bool = False
) -> list[dict[str, torch.Tensor]] | None:
    """Per-micro-batch `{"logp": [rows, seq], "entropy": ...}` under no_grad, in micro-batch order."""

    def loss_fn(i: int, mb: StepBatch, logits: torch.Tensor):  # type: ignore[no-untyped-def]
        logp, entropy = vocab_parallel_logprobs(logits, mb.labels, vocab_size, with_entropy=with_entropy)
        out = {"index": i, "logp": logp.detach()}
        if entropy is not None:
            out["entropy"] = entropy.detach()
        return torch.zeros((), device=logits.device), torch.ones((), dtype=torch.int, device=logits.device), out

    for chunk in chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            results = run_schedule(chunks, batches, loss_fn, forward_only=True)
    finally:
        for chunk in chunks:
            chunk.train()
    if not is_last_stage():
        return None
    return sorted(results, key=lambda d: d["index"])


def forward_full_logits(chunks: list[torch.nn.Module], batch: StepBatch) -> torch.Tensor | None:
    """Full-vocabulary logits `[rows, seq, padded_vocab]` of one micro batch (gathered over TP; last stage)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    def loss_fn(i: int, mb: StepBatch, logits: torch.Tensor):  # type: ignore[no-untyped-def]
        full = gather_from_tensor_model_parallel_region(logits)
        one = torch.ones((), dtype=torch.int, device=logits.device)
        return torch.zeros((), device=logits.device), one, {"index": i, "logits": full.detach()}

    for chunk in chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            results = run_schedule(chunks, [batch], loss_fn, forward_only=True)
    finally:
        for chunk in chunks:
            chunk.train()
    return results[0]["logits"] if is_last_stage() else None
