"""Token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

With tensor parallelism each rank holds logits for a contiguous slice of the (padded) vocabulary. Softmax
statistics are combined across the TP group: the max through a plain all-reduce (a constant shift, no
gradient), the sums through Megatron's `reduce_from_tensor_model_parallel_region` (all-reduce forward,
identity backward), which gives each rank the exact gradient for its slice. Padded vocabulary ids are
masked out, so the result equals the unpadded HF model's log-softmax.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def _tp() -> tuple[int, int, object]:
    parallel_state = sys.modules.get("megatron.core.parallel_state")  # not imported: no TP group exists
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return 0, 1, None
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_group(),
    )


def _reduce(t: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size == 1:
        return t
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(t)


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and the entropy per position from this rank's logits slice `[..., V/tp]` (fp32 math)."""
    tp_rank, tp_size, group = _tp()
    local_vocab = logits.shape[-1]
    start = tp_rank * local_vocab
    ids = torch.arange(start, start + local_vocab, device=logits.device)
    valid = ids < vocab_size
    padded = not bool(valid.all())
    x = logits.float()
    if padded:
        x = x.masked_fill(~valid, float("-inf"))
    with torch.no_grad():
        shift = x.max(dim=-1).values
        if tp_size > 1:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    shifted = x - shift.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = _reduce(exp.sum(dim=-1), tp_size)
    log_z = sum_exp.log()
    in_slice = (targets >= start) & (targets < start + local_vocab)
    local_idx = (targets - start).clamp(0, local_vocab - 1)
    picked = shifted.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1)
    target_logit = torch.where(in_slice, picked, torch.zeros_like(picked))
    target_logit = _reduce(target_logit, tp_size)
    logp = target_logit - log_z
    if not with_entropy:
        return logp, None
    # exp x shifted is 0 x -inf = nan on padded rows. Mask the product in place: the multiplication's backward
    # needs only its inputs, and a torch.where would hold two more vocabulary-sized buffers at the loss's peak.
    product = exp * shifted
    if padded:
        product.masked_fill_(~valid, 0.0)
    weighted = product.sum(dim=-1)
    entropy = log_z - _reduce(weighted, tp_size) / sum_exp
    return logp, entropy
