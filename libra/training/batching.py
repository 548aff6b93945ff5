"""Turn `TrainSample`s into the padded, aligned tensors a worker trains on, and split them into micro batches.

A sample's tokens are `prompt + response`. Position t of the logits predicts token t + 1, so the per-token
tensors are aligned to the *predicting* position: `labels[t] = tokens[t + 1]` and `mask[t] = 1` exactly for
the positions P - 1 .. L - 2 that predict the response tokens (P = prompt length, L = total length).
`rollout_logp` carries the rollout engine's log-prob of each response token at the same positions.

Every sample of a step is right-padded to the step's longest sequence (one shape for every pipeline stage and
micro batch); with causal attention, right padding never changes the real tokens' outputs. Each
data-parallel rank takes a contiguous block of ceil(n / dp) samples, topped up with all-masked dummy rows so
that every rank runs the same number of micro batches of both sizes (training and recomputation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from libra.training.spec import TrainSample

PAD_ID = 0


@dataclass
class StepBatch:
    """This rank's rows of a step, `[rows, seq_len]`; rows >= `num_real` are dummies with an all-zero mask."""

    tokens: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    rollout_logp: torch.Tensor
    advantages: torch.Tensor
    num_real: int

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def to(self, device: str | torch.device) -> StepBatch:
        return StepBatch(
            tokens=self.tokens.to(device),
            positions=self.positions.to(device),
            labels=self.labels.to(device),
            mask=self.mask.to(device),
            rollout_logp=self.rollout_logp.to(device),
            advantages=self.advantages.to(device),
            num_real=self.num_real,
        )

    def slice(self, start: int, stop: int) -> StepBatch:
        return StepBatch(
            tokens=self.tokens[start:stop],
            positions=self.positions[start:stop],
            labels=self.labels[start:stop],
            mask=self.mask[start:stop],
            rollout_logp=self.rollout_logp[start:stop],
            advantages=self.advantages[start:stop],
            num_real=max(0, min(stop, self.num_real) - start),
        )


def validate_samples(samples: Sequence[TrainSample], vocab_size: int, max_len: int) -> None:
    """Raise ValueError naming the first sample that cannot be trained on."""
    if not samples:
        raise ValueError("train_step got no samples")
    for i, s in enumerate(samples):
        if not s.prompt_ids:
            raise ValueError(f"sample {i}: prompt_ids is empty (the first response token needs a prompt token)")
        if not s.response_ids:
            raise ValueError(f"sample {i}: response_ids is empty")
        if len(s.rollout_logprobs) != len(s.response_ids):
            raise ValueError(
                f"sample {i}: {len(s.rollout_logprobs)} rollout_logprobs for {len(s.response_ids)} response tokens"
            )
        total = len(s.prompt_ids) + len(s.response_ids)
        if total > max_len:
            raise ValueError(f"sample {i}: {total} tokens exceed the model's max_position_embeddings={max_len}")
        bad = [t for t in (*s.prompt_ids, *s.response_ids) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"sample {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def step_seq_len(samples: Sequence[TrainSample]) -> int:
    return max(len(s.prompt_ids) + len(s.response_ids) for s in samples)


def rows_per_rank(num_samples: int, dp: int, *micro_batch_sizes: int) -> int:
    """Rows each DP rank holds: ceil(n / dp) rounded up to a multiple of every micro batch size."""
    unit = math.lcm(*micro_batch_sizes) if micro_batch_sizes else 1
    return -(-math.ceil(num_samples / dp) // unit) * unit


def dp_block(num_samples: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """[start, stop) of the samples DP rank `dp_rank` trains on."""
    per = math.ceil(num_samples / dp)
    start = min(num_samples, dp_rank * per)
    return start, min(num_samples, start + per)


def pack(samples: Sequence[TrainSample], rows: int, seq_len: int) -> StepBatch:
    """Pad `samples` into `rows` rows of `seq_len` positions (see module docstring for the alignment)."""
    if len(samples) > rows:
        raise ValueError(f"{len(samples)} samples do not fit in {rows} rows")
    tokens = torch.full((rows, seq_len), PAD_ID, dtype=torch.long)
    labels = torch.full((rows, seq_len), PAD_ID, dtype=torch.long)
    mask = torch.zeros((rows, seq_len), dtype=torch.float32)
    rollout = torch.zeros((rows, seq_len), dtype=torch.float32)
    adv = torch.zeros((rows,), dtype=torch.float32)
    for r, s in enumerate(samples):
        seq = list(s.prompt_ids) + list(s.response_ids)
        n, p = len(seq), len(s.prompt_ids)
        tokens[r, :n] = torch.tensor(seq, dtype=torch.long)
        labels[r, : n - 1] = tokens[r, 1:n]
        mask[r, p - 1 : n - 1] = 1.0
        rollout[r, p - 1 : n - 1] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        adv[r] = float(s.advantage)
    positions = torch.arange(seq_len, dtype=torch.long).unsqueeze(0).expand(rows, -1).contiguous()
    return StepBatch(tokens, positions, labels, mask, rollout, adv, num_real=len(samples))


def micro_batches(batch: StepBatch, size: int) -> list[StepBatch]:
    if batch.rows % size:
        raise ValueError(f"{batch.rows} rows are not a multiple of the micro batch size {size}")
    return [batch.slice(i, i + size) for i in range(0, batch.rows, size)]
