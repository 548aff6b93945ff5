"""The machine speed probe of the gain benchmark: its loop counted per CPU second (the core's speed) and per
wall second (the share of a core it got)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from benchmark_modules import load_benchmark_module

speed_probe = load_benchmark_module("speed_probe")

SPIN = "import os, time\nos.sched_setaffinity(0, {0})\nend = time.time() + 2.0\nwhile time.time() < end:\n    pass\n"


def test_the_probe_runs_for_its_seconds_and_counts_its_loop() -> None:
    figures = speed_probe.probe(0.3)
    assert 0.3 <= figures["seconds"] < 1.0
    assert figures["loop_per_cpu_s"] > 10 * speed_probe.CHUNK  # any machine runs a chunk in well under 0.1 s
    assert 0.0 < figures["cpu_share"] <= 1.05


@pytest.mark.alone  # a share of a core: the suite's other lane would take part of it
def test_a_process_on_the_same_core_lowers_the_share_not_the_speed() -> None:
    affinity = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {0})
        alone = speed_probe.probe(0.5)
        rival = subprocess.Popen([sys.executable, "-c", SPIN])
        try:
            shared = speed_probe.probe(0.8)
        finally:
            rival.kill()
            rival.wait()
    finally:
        os.sched_setaffinity(0, affinity)
    assert shared["cpu_share"] < 0.8 * alone["cpu_share"]
    assert shared["loop_per_cpu_s"] > 0.7 * alone["loop_per_cpu_s"]
