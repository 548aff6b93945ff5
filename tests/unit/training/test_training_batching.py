"""Sample packing (alignment of labels, masks and rollout log-probs), DP blocks, and vocab-parallel
log-probs at TP 1 against torch's log-softmax."""

from __future__ import annotations

import pytest
import torch

from libra.training import batching
from libra.training.logprobs import vocab_parallel_logprobs
from libra.training.spec import TrainSample


def sample(prompt: list[int], response: list[int], adv: float = 1.0) -> TrainSample:
    return TrainSample(prompt, response, [-0.1 * (i + 1) for i in range(len(response))], adv, 0, 0.0)


def test_pack_aligns_predicting_positions() -> None:
    batch = batching.pack([sample([5, 6], [7, 8, 9], adv=0.5)], rows=2, seq_len=6)
    assert batch.tokens[0].tolist() == [5, 6, 7, 8, 9, 0]
    assert batch.labels[0].tolist() == [6, 7, 8, 9, 0, 0]
    # position 1 (token 6) predicts 7, position 3 (token 8) predicts 9
    assert batch.mask[0].tolist() == [0, 1, 1, 1, 0, 0]
    assert batch.rollout_logp[0].tolist() == pytest.approx([0, -0.1, -0.2, -0.3, 0, 0])
    assert batch.advantages.tolist() == [0.5, 0.0]
    assert batch.mask[1].sum() == 0 and batch.num_real == 1


def test_slices_keep_real_row_count() -> None:
    batch = batching.pack([sample([1], [2]), sample([1], [2]), sample([1], [2])], rows=4, seq_len=2)
    parts = batching.micro_batches(batch, 2)
    assert [p.num_real for p in parts] == [2, 1]
    with pytest.raises(ValueError, match="not a multiple"):
        batching.micro_batches(batch, 3)


BLOCKS = {
    "even": (8, 2, [(0, 4), (4, 8)]),
    "uneven": (5, 2, [(0, 3), (3, 5)]),
    "fewer-samples-than-ranks": (1, 2, [(0, 1), (1, 1)]),
}


@pytest.mark.parametrize("n,dp,expected", BLOCKS.values(), ids=BLOCKS.keys())
def test_dp_blocks(n: int, dp: int, expected: list[tuple[int, int]]) -> None:
    assert [batching.dp_block(n, dp, r) for r in range(dp)] == expected


@pytest.mark.parametrize(
    "n,dp,sizes,rows", [(5, 2, (1,), 3), (5, 2, (2,), 4), (5, 2, (2, 3), 6), (8, 4, (4,), 4)]
)
def test_rows_per_rank(n: int, dp: int, sizes: tuple[int, ...], rows: int) -> None:
    assert batching.rows_per_rank(n, dp, *sizes) == rows


BAD = {
    "empty": ([], "no samples"),
    "no-prompt": ([sample([], [3])], "prompt_ids is empty"),
    "no-response": ([sample([3], [])], "response_ids is empty"),
    "logprob-count": ([TrainSample([1], [2, 3], [-1.0], 1.0, 0, 0.0)], "1 rollout_logprobs for 2 response tokens"),
    "too-long": ([sample([1] * 10, [2] * 10)], "20 tokens exceed"),
    "token-out-of-vocab": ([sample([1], [99])], "token id 99 is outside the vocabulary"),
}


@pytest.mark.parametrize("samples,message", BAD.values(), ids=BAD.keys())
def test_validate_samples(samples: list[TrainSample], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        batching.validate_samples(samples, vocab_size=50, max_len=16)


@pytest.mark.parametrize("padded", [0, 3], ids=["exact-vocab", "padded-vocab"])
def test_logprobs_and_entropy_match_log_softmax(padded: int) -> None:
    torch.manual_seed(0)
    vocab = 13
    logits = torch.randn(2, 5, vocab + padded, requires_grad=True)
    targets = torch.randint(0, vocab, (2, 5))
    logp, entropy = vocab_parallel_logprobs(logits, targets, vocab)
    ref = torch.log_softmax(logits[..., :vocab].detach(), dim=-1)
    assert torch.allclose(logp, ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1), atol=1e-6)
    assert entropy is not None
    assert torch.allclose(entropy, -(ref.exp() * ref).sum(-1), atol=1e-5)
    (logp.sum() + entropy.sum()).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert logits.grad[..., vocab:].abs().sum() == 0
