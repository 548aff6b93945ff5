"""Fixtures of the reliability tests: a fresh workspace per test (job file, run directory, `libra launch` as a
subprocess in its own session), reusing the controller tests' small job; whatever a launch leaves running
is stopped at the end. And the tighter rollout health rule the server-fault and node-loss jobs run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from libra.rollout.spec import HealthRule

from ..controller.conftest import make_workspace, stop_everything

# Tighter than the default (45 s bound), so a hung or lost server is failed within 3 x (2 + 5) = 21 s.
TIGHT_HEALTH = HealthRule(interval_s=2.0, timeout_s=5.0, failures_to_fail=3)


def with_health_rule(data: dict[str, Any], rule: HealthRule) -> dict[str, Any]:
    """The job's config data with `rule` as its rollout health rule (rollout_health_check_*, and
    rollout_stall_timeout_s where the rule watches for stalls; else the job's own stays)."""
    data.update(rollout_health_check_interval_s=rule.interval_s, rollout_health_check_timeout_s=rule.timeout_s,
                rollout_health_check_failures=rule.failures_to_fail)
    if rule.stall_s:
        data["rollout_stall_timeout_s"] = rule.stall_s
    return data


@pytest.fixture
def job_workspace(tmp_path: Path) -> Iterator[dict[str, Any]]:
    ws, launches = make_workspace(tmp_path)
    try:
        yield ws
    finally:
        stop_everything(ws["run_dir"], launches)
