"""AlgorithmSpec.errors names the field, the value and the rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from libra.algo.spec import AlgorithmSpec
from libra.config.mapping import algorithm_spec
from libra.config.sections import AlgorithmConfig

BASE = algorithm_spec(AlgorithmConfig())  # the job configuration's defaults

CASES = {
    "defaults-valid": (BASE, []),
    "bad-norm-mode": (replace(BASE, advantage_norm_mode="rank"), ["algorithm.advantage_norm_mode='rank'"]),  # type: ignore[arg-type]
    "bad-agg-mode": (replace(BASE, loss_agg_mode="seq-sum"), ["algorithm.loss_agg_mode='seq-sum'"]),  # type: ignore[arg-type]
    "clip-low-out-of-range": (replace(BASE, clip_ratio_low=1.0), ["algorithm.clip_ratio_low=1.0"]),
    "dual-clip-not-above-one": (replace(BASE, clip_ratio_c=1.0), ["algorithm.clip_ratio_c=1.0 must be > 1"]),
    "negative-entropy": (replace(BASE, entropy_coef=-0.1), ["algorithm.entropy_coef=-0.1"]),
    "bad-kl-type": (replace(BASE, ref_kl=replace(BASE.ref_kl, kl_type="k4")), ["algorithm.ref_kl.kl_type='k4'"]),  # type: ignore[arg-type]
    "is-bounds-inverted": (
        replace(BASE, is_correction=replace(BASE.is_correction, enable=True, lower_bound=2.0, upper_bound=0.5)),
        ["algorithm.is_correction bounds [2.0, 0.5]"],
    ),
    "collects-every-error": (
        replace(BASE, clip_ratio_low=-0.1, entropy_coef=-1.0),
        ["algorithm.clip_ratio_low=-0.1", "algorithm.entropy_coef=-1.0"],
    ),
}


@pytest.mark.parametrize("spec,expected", CASES.values(), ids=CASES.keys())
def test_algorithm_spec_errors(spec: AlgorithmSpec, expected: list[str]) -> None:
    errors = spec.errors()
    assert len(errors) == len(expected)
    for err, want in zip(errors, expected, strict=True):
        assert err.startswith(want)
