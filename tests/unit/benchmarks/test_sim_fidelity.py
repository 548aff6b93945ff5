"""The simulator-fidelity benchmark: its three grids are the sizes it states and share no job, and its summary
counts what it says."""

from __future__ import annotations

import pytest
from benchmark_modules import load_benchmark_module

sim_fidelity = load_benchmark_module("sim_fidelity")


def test_the_grids_are_the_sizes_they_state_and_share_no_job() -> None:
    derived, held_out, pool = list(sim_fidelity.derived()), list(sim_fidelity.held_out()), list(sim_fidelity.pool())
    assert len(derived) == len(set(derived)) == 288
    assert len(held_out) == len(set(held_out)) == 288
    assert len(pool) == len(set(pool)) == 144
    assert not set(derived) & set(held_out) and not (set(derived) | set(held_out)) & set(pool)
    assert {case.instances for case in derived + held_out} == {1} and {case.instances for case in pool} == {2, 4}


def test_summary() -> None:
    out = sim_fidelity.summary([0.1, -0.2, 0.05, 0.0])
    assert out["jobs"] == 4
    assert out["mean_abs_rel_error"] == pytest.approx(0.0875)
    assert out["max_abs_rel_error"] == pytest.approx(0.2)
    assert out["within_15pct"] == pytest.approx(0.75)
    assert out["mean_rel_error"] == pytest.approx(-0.0125)
