"""Where a run's time went, interval by interval: the split in force, seconds per step, pool busy shares and the
reconfigurations paid."""

from __future__ import annotations

import pytest
from sim_cases import Scripted, fixed_job, split

from planner.sim.engine import Engine, SimOptions
from planner.sim.policies import StaticPolicy
from planner.sim.report import intervals
from planner.workload import CostParams


def test_synchronous_run_by_hand() -> None:
    # 2 steps: generate 1 s, train 1 s, reload 1 s (the second step waits for it): steps end at 2 and 5
    job = fixed_job(steps=2)
    result = Engine(job, StaticPolicy(split(job, 2)), SimOptions(steps=2)).run()
    rows = intervals(result, 1)
    assert [r["step_s"] for r in rows] == [2.0, 3.0]
    assert [r["rollout_busy_share"] for r in rows] == [0.5, pytest.approx(1 / 3, abs=1e-3)]
    assert [r["train_busy_share"] for r in rows] == [0.5, pytest.approx(1 / 3, abs=1e-3)]
    assert all((r["train_gpus"], r["rollout_gpus"], r["switches"]) == (2, 6, 0) for r in rows)


@pytest.mark.parametrize("every, switch_row", [pytest.param(2, 1, id="every-2"), pytest.param(3, 0, id="every-3"),
                                               pytest.param(6, 0, id="one-row")])
def test_switch_is_counted_where_it_was_paid(every: int, switch_row: int) -> None:
    job = fixed_job(steps=6, samples=64, offpolicy=1, cost=CostParams(rollout_restart_s=30.0, train_restart_s=50.0))
    result = Engine(job, Scripted(split(job, 2), {2: split(job, 4)}), SimOptions(steps=6)).run()
    rows = intervals(result, every)
    assert sum(r["step_s"] * (r["steps"][1] - r["steps"][0]) for r in rows) == pytest.approx(result.wall_s, abs=0.05)
    assert [r["switches"] for r in rows] == [int(i == switch_row) for i in range(len(rows))]
    assert rows[switch_row]["switch_pause_s"] == 50.0  # diff: the training pool re-forms, the rollout keeps serving
    if len(rows) > 1:
        assert (rows[-1]["train_gpus"], rows[-1]["rollout_gpus"]) == (4, 4)


def test_every_must_be_positive() -> None:
    job = fixed_job(steps=2)
    with pytest.raises(ValueError, match="every: 0"):
        intervals(Engine(job, StaticPolicy(split(job, 2)), SimOptions(steps=2)).run(), 0)
