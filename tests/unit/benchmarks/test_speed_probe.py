"""The machine speed probe of the gain benchmark: its loop counted per CPU second (the core's speed) and per
wall second (the share of a core it got)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

import pytest
from benchmark_modules import load_benchmark_module

speed_probe = load_benchmark_module("speed_probe")

ROUNDS = 3
SPIN = "import os, time\nos.sched_setaffinity(0, {0})\nend = time.time() + 2.0\nwhile time.time() < end:\n    pass\n"


def test_the_probe_runs_for_its_seconds_and_counts_its_loop() -> None:
    figures = speed_probe.probe(0.3)
    assert 0.3 <= figures["seconds"] < 1.0
    assert figures["loop_per_cpu_s"] > 10 * speed_probe.CHUNK  # any machine runs a chunk in well under 0.1 s
    assert 0.0 < figures["cpu_share"] <= 1.05


@pytest.mark.alone  # a share of a core: the suite's other lane would take part of it
def test_a_process_on_the_same_core_lowers_the_share_not_the_speed() -> None:
    """Three rounds of a probe alone and one beside a rival on the same core: the share drops, the loop per CPU
    second does not. A busy host slows a round now and then (stolen time), never speeds one up, so the speeds
    compare the best round of each side and the shares their medians."""
    affinity = os.sched_getaffinity(0)
    alone: list[dict[str, float]] = []
    shared: list[dict[str, float]] = []
    try:
        os.sched_setaffinity(0, {0})
        for _ in range(ROUNDS):
            alone.append(speed_probe.probe(0.3))
            rival = subprocess.Popen([sys.executable, "-c", SPIN])
            try:
                shared.append(speed_probe.probe(0.6))
            finally:
                rival.kill()
                rival.wait()
    finally:
        os.sched_setaffinity(0, affinity)
    assert statistics.median(f["cpu_share"] for f in shared) < 0.8 * statistics.median(f["cpu_share"] for f in alone)
    assert max(f["loop_per_cpu_s"] for f in shared) > 0.7 * max(f["loop_per_cpu_s"] for f in alone)
