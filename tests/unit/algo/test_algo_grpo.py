"""GRPO loss pieces against hand-computed cases: clipping and dual clip, aggregation, KL estimators, IS
correction and the combined loss, plus where gradients must vanish."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from libra.algo.grpo import (
    LossInputs,
    aggregate,
    aggregate_sums,
    grpo_loss,
    grpo_loss_sums,
    is_correction_weights,
    kl_penalty,
    ppo_clipped_loss,
)
from libra.config.mapping import algorithm_spec
from libra.config.sections import AlgorithmConfig

BASE = algorithm_spec(AlgorithmConfig())  # the job configuration's defaults

E = math.e

# (log ratio, advantage) -> (loss, clip bound binds, dual clip binds); clip 0.2 / 0.28, clip_c 10
CLIP_CASES = {
    "on-policy": (0.0, 1.0, -1.0, 0, 0),
    "pos-adv-ratio-above-clip": (0.5, 1.0, -1.28, 1, 0),
    "pos-adv-ratio-below-clip-unclipped": (-0.5, 1.0, -math.exp(-0.5), 0, 0),
    "neg-adv-ratio-below-clip": (-0.5, -1.0, 0.8, 1, 0),
    "neg-adv-ratio-above-clip-unclipped": (0.1, -1.0, math.exp(0.1), 0, 0),
    "neg-adv-dual-clip": (3.0, -1.0, 10.0, 0, 1),
    "neg-adv-half-dual-clip": (3.0, -0.5, 5.0, 0, 1),
    "pos-adv-huge-ratio-clipped": (3.0, 2.0, -2.56, 1, 0),
}


@pytest.mark.parametrize("log_ratio,adv,loss,clipped,dual", CLIP_CASES.values(), ids=CLIP_CASES.keys())
def test_ppo_clipped_loss(log_ratio: float, adv: float, loss: float, clipped: int, dual: int) -> None:
    logp = torch.tensor([[log_ratio - 1.0]])
    old = torch.tensor([[-1.0]])
    out, clip_mask, dual_mask = ppo_clipped_loss(logp, old, torch.tensor([adv]), 0.2, 0.28, 10.0)
    assert out.item() == pytest.approx(loss, rel=1e-5)
    assert clip_mask.item() == clipped
    assert dual_mask.item() == dual


GRAD_CASES = {
    "unclipped-has-gradient": (0.1, 1.0, True),
    "clipped-high-no-gradient": (0.5, 1.0, False),
    "clipped-low-no-gradient": (-0.5, -1.0, False),
    "dual-clipped-no-gradient": (3.0, -1.0, False),
}


@pytest.mark.parametrize("log_ratio,adv,has_grad", GRAD_CASES.values(), ids=GRAD_CASES.keys())
def test_clipped_tokens_carry_no_gradient(log_ratio: float, adv: float, has_grad: bool) -> None:
    logp = torch.tensor([[log_ratio]], requires_grad=True)
    loss, _, _ = ppo_clipped_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), 0.2, 0.28, 10.0)
    loss.sum().backward()
    assert logp.grad is not None
    assert (logp.grad.abs().item() > 0) == has_grad
    if has_grad:  # d(-A * exp(x)) / dx
        assert logp.grad.item() == pytest.approx(-adv * math.exp(log_ratio), rel=1e-5)


VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
AGG_CASES = {
    "token-mean": (VALUES, [[1, 1, 1], [1, 0, 0]], "token-mean", 2.5, 4.0),
    "seq-mean-token-mean": (VALUES, [[1, 1, 1], [1, 0, 0]], "seq-mean-token-mean", 3.0, 2.0),
    "seq-mean-skips-empty-sequence": (VALUES, [[1, 0, 1], [0, 0, 0]], "seq-mean-token-mean", 2.0, 1.0),
    "token-mean-all-masked-is-zero": (VALUES, [[0, 0, 0], [0, 0, 0]], "token-mean", 0.0, 0.0),
}


@pytest.mark.parametrize("values,mask,mode,mean,units", AGG_CASES.values(), ids=AGG_CASES.keys())
def test_aggregate(values: torch.Tensor, mask: list[list[int]], mode: str, mean: float, units: float) -> None:
    m = torch.tensor(mask, dtype=torch.float32)
    assert aggregate(values, m, mode).item() == pytest.approx(mean)
    assert aggregate_sums(values, m, mode)[1].item() == units


def test_aggregate_sums_are_split_invariant() -> None:
    """Summing numerators and units over shards and dividing once equals the whole-batch aggregate."""
    torch.manual_seed(0)
    values, mask = torch.randn(6, 5), (torch.rand(6, 5) > 0.3).float()
    for mode in ("token-mean", "seq-mean-token-mean"):
        parts = [aggregate_sums(values[i : i + 2], mask[i : i + 2], mode) for i in (0, 2, 4)]
        split = torch.stack([p[0] for p in parts]).sum() / torch.stack([p[1] for p in parts]).sum()
        assert split.item() == pytest.approx(aggregate(values, mask, mode).item(), rel=1e-6)


KL_CASES = {
    "k1-positive": (-1.0, -2.0, "k1", 1.0),
    "k1-negative": (-2.0, -1.0, "k1", -1.0),
    "k2": (-1.0, -2.0, "k2", 0.5),
    "k3-positive-log-ratio": (-1.0, -2.0, "k3", math.exp(-1.0)),
    "k3-negative-log-ratio": (-2.0, -1.0, "k3", E - 2.0),
    "k3-equal-is-zero": (-1.5, -1.5, "k3", 0.0),
}


@pytest.mark.parametrize("logp,ref,kind,expected", KL_CASES.values(), ids=KL_CASES.keys())
def test_kl_penalty(logp: float, ref: float, kind: str, expected: float) -> None:
    assert kl_penalty(torch.tensor(logp), torch.tensor(ref), kind).item() == pytest.approx(expected, rel=1e-5)


OLD = torch.tensor([[-1.0, -1.0]])
ROLLOUT = torch.tensor([[-2.0, -1.0]])  # log ratios [1, 0]
IS_CASES = {
    "token-clip": ("token", "clip", [[2.0, 1.0]], [[1, 1]]),
    "token-mask": ("token", "mask", [[0.0, 1.0]], [[0, 1]]),
    "sequence-clip": ("sequence", "clip", [[2.0, 2.0]], [[1, 1]]),
    "sequence-mask-drops-sequence": ("sequence", "mask", [[0.0, 0.0]], [[0, 0]]),
    "geometric-within-bounds": ("geometric", "mask", [[math.exp(0.5)] * 2], [[1, 1]]),
}


@pytest.mark.parametrize("level,action,weights,mask", IS_CASES.values(), ids=IS_CASES.keys())
def test_is_correction(level: str, action: str, weights: list[list[float]], mask: list[list[int]]) -> None:
    w, m = is_correction_weights(OLD, ROLLOUT, torch.ones(1, 2), level, action, 0.5, 2.0)
    assert torch.allclose(w, torch.tensor(weights), rtol=1e-5)
    assert m.tolist() == [[float(x) for x in row] for row in mask]


def test_combined_loss_hand_computed() -> None:
    """pg = -0.5 per token; k1 KL [0.5, 0] x 0.1; entropy [2, 3] x 0.01 -> L = [-0.47, -0.53], mean -0.5."""
    spec = replace(BASE, entropy_coef=0.01, ref_kl=replace(BASE.ref_kl, enable=True, coef=0.1, kl_type="k1"))
    x = LossInputs(
        logp=torch.tensor([[-1.0, -2.0]]),
        old_logp=torch.tensor([[-1.0, -2.0]]),
        rollout_logp=torch.tensor([[-1.25, -2.0]]),
        advantages=torch.tensor([0.5]),
        mask=torch.ones(1, 2),
        entropy=torch.tensor([[2.0, 3.0]]),
        ref_logp=torch.tensor([[-1.5, -2.0]]),
    )
    assert grpo_loss(x, spec).item() == pytest.approx(-0.5)
    num, units, metrics = grpo_loss_sums(x, spec, use_is=False)
    assert (num.item(), units.item()) == pytest.approx((-1.0, 2.0))
    assert metrics["kl_sum"].item() == pytest.approx(0.5)
    assert metrics["entropy_sum"].item() == pytest.approx(5.0)
    assert metrics["gap_sum"].item() == pytest.approx(0.25)
    assert metrics["tokens"].item() == 2


def test_is_mask_changes_the_denominator() -> None:
    """With IS masking the dropped token leaves numerator and denominator: mean over the kept token only."""
    spec = replace(BASE, is_correction=replace(BASE.is_correction, enable=True, action="mask", lower_bound=0.5, upper_bound=2.0))
    x = LossInputs(
        logp=OLD.clone(), old_logp=OLD, rollout_logp=ROLLOUT, advantages=torch.tensor([1.0]), mask=torch.ones(1, 2)
    )
    num, units, metrics = grpo_loss_sums(x, spec, use_is=True)
    assert (num.item(), units.item(), metrics["is_kept"].item()) == (-1.0, 1.0, 1.0)


def test_ref_kl_without_reference_is_an_error() -> None:
    spec = replace(BASE, ref_kl=replace(BASE.ref_kl, enable=True))
    x = LossInputs(logp=OLD, old_logp=OLD, rollout_logp=OLD, advantages=torch.tensor([1.0]), mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="reference log-probs"):
        grpo_loss(x, spec)
