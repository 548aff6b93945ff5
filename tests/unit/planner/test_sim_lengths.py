"""Drifting, long-tailed response lengths: the drift, the tail, truncation, the seed, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from planner.sim.lengths import BatchStats, DriftCurve, LengthModel, draw_batches


@pytest.mark.parametrize("curve, progress, value", [
    pytest.param(DriftCurve(500, 3000, 1.0), 0.0, 500, id="start"),
    pytest.param(DriftCurve(500, 3000, 1.0), 0.5, 1750, id="half-way"),
    pytest.param(DriftCurve(500, 3000, 1.0), 1.0, 3000, id="end"),
    pytest.param(DriftCurve(500, 3000, 0.4), 0.2, 1750, id="half-way-of-a-short-ramp"),
    pytest.param(DriftCurve(500, 3000, 0.4), 0.9, 3000, id="after-the-ramp-it-stays"),
    pytest.param(DriftCurve(8, 64, 100), -5, 8, id="before-the-start"),
    pytest.param(DriftCurve(900, 300, 10), 5, 600, id="falling"),
])
def test_drift_curve(curve: DriftCurve, progress: float, value: float) -> None:
    assert curve.at(progress) == pytest.approx(value)


def test_mean_drifts_from_start_to_end() -> None:
    model = LengthModel(500, 3000, 8192)
    assert model.mean_at(0.0) == pytest.approx(500)
    assert model.mean_at(1.0) == pytest.approx(3000)
    means = [model.mean_at(f) for f in np.linspace(0, 1, 11)]
    assert all(b > a for a, b in zip(means[:-1], means[1:], strict=True))
    assert LengthModel(500, 3000, 8192, drift=False).mean_at(0.9) == 500


def test_batches_follow_the_drift_with_a_long_tail_and_truncation() -> None:
    stats = draw_batches(LengthModel(400, 2000, 4096), steps=20, samples_per_step=4000, seed=3)
    early, late = stats.mean(0), stats.mean(19)
    assert early == pytest.approx(400 + 1600 * 0.5 / 20, rel=0.1) and late > 3 * early  # step 0 is 1/40 in
    assert stats.length_biased_mean(0) > 1.5 * early  # long tail: E[L^2]/E[L] well above the mean
    assert stats.longest.max() <= 4096


@pytest.mark.parametrize("seed_a, seed_b, same", [pytest.param(1, 1, True, id="same-seed"),
                                                   pytest.param(1, 2, False, id="other-seed")])
def test_seeded(seed_a: int, seed_b: int, same: bool) -> None:
    model = LengthModel(300, 900, 2048)
    a = draw_batches(model, 5, 100, seed_a)
    b = draw_batches(model, 5, 100, seed_b)
    assert np.array_equal(a.total, b.total) is same


@pytest.mark.parametrize("kwargs, field", [
    pytest.param({"start_mean": 0}, "start_mean", id="start"),
    pytest.param({"end_mean": 10_000}, "end_mean", id="end-above-max"),
    pytest.param({"sigma": -1}, "sigma", id="sigma"),
    pytest.param({"ramp": 0.0}, "ramp", id="ramp"),
])
def test_bad_models_name_the_field(kwargs: dict[str, float], field: str) -> None:
    values = {"start_mean": 100.0, "end_mean": 200.0, "max_new_tokens": 1000, **kwargs}
    with pytest.raises(ValueError, match=field):
        draw_batches(LengthModel(**values), 2, 10, 0)  # type: ignore[arg-type]


def test_stats_of_known_lengths() -> None:
    stats = BatchStats.of_lengths(np.array([[1, 3, 2, 2], [4, 1, 1, 1]]), group_size=2)
    assert stats.count.tolist() == [4, 4] and stats.total.tolist() == [8.0, 7.0]
    assert stats.longest.tolist() == [3.0, 4.0] and stats.sum_squares.tolist() == [18.0, 19.0]
    assert stats.group_longest is not None and stats.group_longest.tolist() == [5.0, 5.0]
    assert stats.group_fill(0) == pytest.approx(8 / (2 * 5))


def test_drawn_batches_are_the_stats_of_their_draws() -> None:
    model, steps, per_step, group = LengthModel(300, 900, 2048), 4, 60, 4
    rng = np.random.default_rng(7)
    lengths = np.array([model.draw(rng, model.mean_at((k + 0.5) / steps), per_step) for k in range(steps)])
    drawn, known = draw_batches(model, steps, per_step, seed=7, group_size=group), BatchStats.of_lengths(lengths, group)
    for field in ("count", "total", "longest", "sum_squares", "group_longest"):
        assert np.array_equal(getattr(drawn, field), getattr(known, field)), field


@pytest.mark.parametrize("lengths, group_size", [
    pytest.param(np.ones(6), 2, id="one-row-not-a-table"),
    pytest.param(np.ones((2, 6)), 4, id="rows-not-whole-groups"),
    pytest.param(np.ones((2, 6)), 0, id="group-size-zero"),
])
def test_stats_of_lengths_refuse_a_bad_shape(lengths: np.ndarray, group_size: int) -> None:
    with pytest.raises(ValueError, match="group_size"):
        BatchStats.of_lengths(lengths, group_size)
