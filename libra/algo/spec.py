"""Algorithm settings of a GRPO run: advantage normalization, policy-loss clipping, aggregation, reference KL,
entropy bonus and truncated importance-sampling correction. Field names follow the peer references
(`algorithm.*`, `algorithm.ref_kl.*`, `algorithm.is_correction.*`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ADVANTAGE_NORM_MODES = ("none", "group_mean", "group_zscore", "batch_mean", "batch_zscore")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")
KL_TYPES = ("k1", "k2", "k3")
IS_LEVELS = ("token", "sequence", "geometric")
IS_ACTIONS = ("clip", "mask")

AdvantageNormMode = Literal["none", "group_mean", "group_zscore", "batch_mean", "batch_zscore"]
LossAggMode = Literal["token-mean", "seq-mean-token-mean"]


@dataclass(frozen=True, kw_only=True)
class RefKLSpec:
    """KL(pi_theta || pi_ref) penalty; the reference is the initial weights kept on the training workers."""

    enable: bool
    coef: float
    kl_type: Literal["k1", "k2", "k3"]


@dataclass(frozen=True, kw_only=True)
class ISCorrectionSpec:
    """Truncated importance sampling between the rollout policy and the (recomputed) old policy.

    weight = pi_old / pi_rollout per token (`token`), its product over the response (`sequence`) or the
    geometric mean of the per-token ratios (`geometric`); out-of-bound weights are clamped (`clip`) or the
    token/sequence is dropped from both numerator and denominator (`mask`).
    """

    enable: bool
    action: Literal["clip", "mask"]
    level: Literal["token", "sequence", "geometric"]
    lower_bound: float
    upper_bound: float


@dataclass(frozen=True, kw_only=True)
class AlgorithmSpec:
    """GRPO loss settings (see cluster_manual/training.md for the formulas). Every field is the user's
    (`algorithm.*`, built by `libra.config.mapping.algorithm_spec`): no defaults here."""

    advantage_norm_mode: AdvantageNormMode
    loss_agg_mode: LossAggMode
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    entropy_coef: float
    ref_kl: RefKLSpec
    is_correction: ISCorrectionSpec

    def errors(self, prefix: str = "algorithm") -> list[str]:
        """Every problem with the settings, each naming the field, the value and the rule."""
        out: list[str] = []
        if self.advantage_norm_mode not in ADVANTAGE_NORM_MODES:
            out.append(
                f"{prefix}.advantage_norm_mode='{self.advantage_norm_mode}' is not one of {', '.join(ADVANTAGE_NORM_MODES)}"
            )
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            out.append(f"{prefix}.loss_agg_mode='{self.loss_agg_mode}' is not one of {', '.join(LOSS_AGG_MODES)}")
        if not 0.0 <= self.clip_ratio_low < 1.0:
            out.append(f"{prefix}.clip_ratio_low={self.clip_ratio_low} must be in [0, 1)")
        if self.clip_ratio_high < 0.0:
            out.append(f"{prefix}.clip_ratio_high={self.clip_ratio_high} must be >= 0")
        if self.clip_ratio_c <= 1.0:
            out.append(f"{prefix}.clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip bound for negative advantages)")
        if self.entropy_coef < 0.0:
            out.append(f"{prefix}.entropy_coef={self.entropy_coef} must be >= 0")
        if self.ref_kl.kl_type not in KL_TYPES:
            out.append(f"{prefix}.ref_kl.kl_type='{self.ref_kl.kl_type}' is not one of {', '.join(KL_TYPES)}")
        if self.ref_kl.enable and self.ref_kl.coef < 0.0:
            out.append(f"{prefix}.ref_kl.coef={self.ref_kl.coef} must be >= 0")
        isc = self.is_correction
        if isc.level not in IS_LEVELS:
            out.append(f"{prefix}.is_correction.level='{isc.level}' is not one of {', '.join(IS_LEVELS)}")
        if isc.action not in IS_ACTIONS:
            out.append(f"{prefix}.is_correction.action='{isc.action}' is not one of {', '.join(IS_ACTIONS)}")
        if isc.enable and not 0.0 < isc.lower_bound <= 1.0 <= isc.upper_bound:
            out.append(
                f"{prefix}.is_correction bounds [{isc.lower_bound}, {isc.upper_bound}] must satisfy "
                "0 < lower_bound <= 1 <= upper_bound"
            )
        return out
