"""GRPO loss in pure torch: clipped policy-gradient term with dual clip, reference KL estimators, entropy
bonus, truncated importance-sampling correction and the two aggregation modes.

All per-token tensors are `[batch, tokens]` with a 0/1 `mask` of response tokens. For the pieces:

    ratio_t = exp(logp_t - old_logp_t)
    pg_t    = max(-A * ratio_t, -A * clip(ratio_t, 1 - clip_low, 1 + clip_high))
    pg_t    = min(pg_t, -A * clip_c)                  for A < 0 (dual clip)
    L_t     = w_t * pg_t + kl_coef * kl_t - entropy_coef * H_t

with `w_t` the (detached) truncated IS weight. Aggregation:

    token-mean:           sum_{i,t} L * m / sum_{i,t} m
    seq-mean-token-mean:  mean_i [ sum_t L_i * m_i / sum_t m_i ]   (over sequences with any token)

`grpo_loss_sums` returns the numerator and the unit count separately so that micro batches and data-parallel
ranks can be summed first and divided once, which makes the result independent of how the batch is split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from libra.algo.spec import AlgorithmSpec


def ppo_clipped_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped PG loss with dual clip; also 0/1 tensors marking where the clip and dual clip bind."""
    adv = advantages if advantages.dim() == logp.dim() else advantages.unsqueeze(-1).expand_as(logp)
    ratio = torch.exp(logp - old_logp)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).to(logp.dtype)
    dual_bound = -adv * clip_c
    dual = ((adv < 0) & (loss > dual_bound)).to(logp.dtype)
    loss = torch.where(adv < 0, torch.minimum(loss, dual_bound), loss)
    return loss, clipped, dual


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi: k1 = log r, k2 = (log r)^2 / 2,
    k3 = exp(-log r) + log r - 1, with log r = logp - ref_logp."""
    log_ratio = logp - ref_logp
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    if kl_type == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"kl_type='{kl_type}' is not one of k1, k2, k3")


def is_correction_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    action: str,
    lower: float,
    upper: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated IS weights pi_old / pi_rollout (detached) and the mask after `action`.

    `token`: per token; `sequence`: exp(sum_t log-ratio) for the whole response; `geometric`:
    exp(mean_t log-ratio). `clip` clamps to [lower, upper]; `mask` zeroes the weight and the mask of
    out-of-bound tokens (token level) or whole sequences (sequence / geometric).
    """
    log_ratio = (old_logp - rollout_logp).detach() * mask
    if level == "token":
        weights = torch.exp(log_ratio)
    elif level in ("sequence", "geometric"):
        total = log_ratio.sum(-1, keepdim=True)
        if level == "geometric":
            total = total / mask.sum(-1, keepdim=True).clamp(min=1.0)
        weights = torch.exp(total).expand_as(log_ratio)
    else:
        raise ValueError(f"is_correction.level='{level}' is not one of token, sequence, geometric")
    if action == "clip":
        return weights.clamp(lower, upper) * mask, mask
    if action == "mask":
        keep = ((weights >= lower) & (weights <= upper)).to(mask.dtype) * mask
        return weights * keep, keep
    raise ValueError(f"is_correction.action='{action}' is not one of clip, mask")


def aggregate_sums(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, units) of the aggregate: the mean is numerator / units once summed over all shards."""
    if mode == "token-mean":
        return (per_token * mask).sum(), mask.sum()
    if mode == "seq-mean-token-mean":
        tokens = mask.sum(-1)
        has_tokens = (tokens > 0).to(per_token.dtype)
        seq_means = (per_token * mask).sum(-1) / tokens.clamp(min=1.0)
        return (seq_means * has_tokens).sum(), has_tokens.sum()
    raise ValueError(f"loss_agg_mode='{mode}' is not one of token-mean, seq-mean-token-mean")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The aggregate itself (numerator / units; 0 when there is nothing to average)."""
    num, units = aggregate_sums(per_token, mask, mode)
    return num / units.clamp(min=1.0)


@dataclass
class LossInputs:
    """Per-token tensors of one micro batch; `ref_logp` only with the reference KL enabled."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    rollout_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None


METRIC_SUM_KEYS = ("clip_count", "dual_clip_count", "kl_sum", "entropy_sum", "gap_sum", "tokens", "is_kept")


def grpo_loss_sums(x: LossInputs, spec: AlgorithmSpec, use_is: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(loss numerator, units, metric sums) of the GRPO loss for one micro batch.

    Metric sums are token sums over the response mask (before IS masking): clipped tokens, dual-clipped
    tokens, KL, entropy, |logp - rollout_logp| (train vs rollout gap), token count and IS-kept tokens.
    """
    mask = x.mask.to(x.logp.dtype)
    pg, clipped, dual = ppo_clipped_loss(
        x.logp, x.old_logp, x.advantages, spec.clip_ratio_low, spec.clip_ratio_high, spec.clip_ratio_c
    )
    loss_mask = mask
    if use_is:
        isc = spec.is_correction
        weights, loss_mask = is_correction_weights(
            x.old_logp, x.rollout_logp, mask, isc.level, isc.action, isc.lower_bound, isc.upper_bound
        )
        pg = pg * weights
    per_token = pg
    kl = torch.zeros_like(x.logp)
    if spec.ref_kl.enable:
        if x.ref_logp is None:
            raise ValueError("ref_kl is enabled but no reference log-probs were computed")
        kl = kl_penalty(x.logp, x.ref_logp, spec.ref_kl.kl_type)
        per_token = per_token + spec.ref_kl.coef * kl
    entropy = x.entropy if x.entropy is not None else torch.zeros_like(x.logp)
    if spec.entropy_coef:
        per_token = per_token - spec.entropy_coef * entropy
    num, units = aggregate_sums(per_token, loss_mask, spec.loss_agg_mode)
    with torch.no_grad():
        metrics = {
            "clip_count": (clipped * mask).sum(),
            "dual_clip_count": (dual * mask).sum(),
            "kl_sum": (kl * mask).sum(),
            "entropy_sum": (entropy * mask).sum(),
            "gap_sum": ((x.logp - x.rollout_logp).abs() * mask).sum(),
            "tokens": mask.sum(),
            "is_kept": loss_mask.sum(),
        }
    return num, units, {k: v.detach() for k, v in metrics.items()}


def grpo_loss(x: LossInputs, spec: AlgorithmSpec, use_is: bool = False) -> torch.Tensor:
    """The aggregated GRPO loss of one batch (single-shard convenience over `grpo_loss_sums`)."""
    num, units, _ = grpo_loss_sums(x, spec, use_is)
    return num / units.clamp(min=1.0)
