"""The EHP part's wait for the machine to calm down: it ends once the load is at most the cores or has stopped
falling (something that stays, the benchmark's own Ray cluster, keeps it above the cores)."""

from __future__ import annotations

import pytest
from benchmark_modules import load_benchmark_module

gain = load_benchmark_module("elastic_gain")


def _every_5s(*loads: float) -> list[tuple[float, float]]:
    return [(5.0 * i, load) for i, load in enumerate(loads)]


@pytest.mark.parametrize(("samples", "settled"), [
    pytest.param([], False, id="no-sample-yet"),
    pytest.param(_every_5s(1.5), True, id="below-the-cores-at-once"),
    pytest.param(_every_5s(3.0, 2.8, 2.6), False, id="still-falling-too-soon-to-say"),
    pytest.param(_every_5s(3.5, 3.3, 3.1, 2.9, 2.7, 2.5, 2.3), False, id="falling-for-30-s"),
    pytest.param(_every_5s(2.6, 2.58, 2.57, 2.55, 2.54, 2.53, 2.52), True, id="flat-above-the-cores"),
    pytest.param(_every_5s(3.0, 2.9, 2.8, 2.75, 2.7, 2.6, 2.55, 2.52, 2.5), False, id="still-falling-0.25-in-30-s"),
    pytest.param(_every_5s(2.5, 2.5, 2.5, 2.5, 2.5, 2.5, 2.7), True, id="rising-again"),
])
def test_load_settled(samples: list[tuple[float, float]], settled: bool) -> None:
    assert gain.load_settled(samples, cores=2) is settled
