"""From a collected batch of scored groups to training samples and the step's rollout metrics.

Advantages are computed over the whole batch at once (the batch_* modes need it; the group_* modes
normalise within each prompt's group of `n_samples` responses).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from libra.algo.advantages import compute_advantages
from libra.controller.batching import Group


def build_samples(groups: Sequence[Group], advantage_mode: str, sample_cls: type) -> list[Any]:
    """One `sample_cls` (libra.training `TrainSample`) per response, advantages attached."""
    if not groups:
        return []
    group_size = groups[0].size
    if any(g.size != group_size for g in groups):
        raise ValueError(f"groups of unequal size {sorted({g.size for g in groups})}: every prompt needs n_samples")
    rewards = [r for g in groups for r in g.rewards]
    advantages = compute_advantages(rewards, group_size, advantage_mode)
    samples = []
    i = 0
    for group in groups:
        for response, logprobs, version, reward in zip(
            group.responses, group.logprobs, group.versions, group.rewards, strict=True
        ):
            samples.append(
                sample_cls(
                    prompt_ids=list(group.prompt_ids),
                    response_ids=list(response),
                    rollout_logprobs=list(logprobs),
                    advantage=float(advantages[i]),
                    policy_version=int(version),
                    reward=float(reward),
                )
            )
            i += 1
    return samples


def rollout_metrics(groups: Sequence[Group], step: int) -> dict[str, float]:
    """Reward and response statistics of a batch (the `reward_mean` of metrics.jsonl comes from here)."""
    rewards = [r for g in groups for r in g.rewards]
    lengths = [len(resp) for g in groups for resp in g.responses]
    lags = [step - g.policy_version for g in groups]
    uniform = sum(1 for g in groups if len(set(g.rewards)) <= 1)
    truncated = sum(1 for g in groups for f in g.finish_reasons if f == "length")
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "reward_max": max(rewards) if rewards else 0.0,
        "response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "response_tokens": float(sum(lengths)),
        "samples": float(len(rewards)),
        "groups_uniform_reward_frac": uniform / len(groups) if groups else 0.0,
        "truncated_frac": truncated / len(lengths) if lengths else 0.0,
        "policy_lag_mean": statistics.fmean(lags) if lags else 0.0,
        "policy_lag_max": float(max(lags)) if lags else 0.0,
    }
