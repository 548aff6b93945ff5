"""The health rule: an instance has failed only after `failures_to_fail` checks in a row got no answer; the
monitor applies it to READY instances only (a reloading or starting server may not answer for a while); the
rule comes from the job's `rollout_health_check_*` options."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from libra.config import load_dict
from libra.config.mapping import rollout_pool_spec
from libra.rollout import health
from libra.rollout.router import FAILED, READY, RELOADING, InstanceSlot, Router
from libra.rollout.spec import HealthRule, HostGoneError, HostUnreachableError

QWEN_7B = Path(__file__).resolve().parents[3] / "configs" / "models" / "qwen2.5-7b"
BASE = {"model_path": str(QWEN_7B), "cluster": {"num_nodes": 1, "gpus_per_node": 8, "gpu_type": "H100"},
        "train_gpus": 4, "rollout_gpus": 4, "global_resource_planner": {"initial_allocation_strategy": "configured"}}


class Answers:
    """A server whose /health answers from the `answer_from`-th check on (0 = never)."""

    def __init__(self, answer_from: int) -> None:
        self.answer_from = answer_from
        self.checks = 0

    async def health(self, timeout_s: float = 5.0) -> bool:
        self.checks += 1
        return 0 < self.answer_from <= self.checks


@pytest.mark.parametrize(("failures", "answer_from", "answers", "checks"), [
    (3, 1, True, 1), (3, 3, True, 3), (3, 4, False, 3), (3, 0, False, 3), (1, 2, False, 1), (5, 5, True, 5),
], ids=["at-once", "at-the-last-check", "too-late", "never", "one-miss-fails", "five-allowed"])
def test_answers_health(failures: int, answer_from: int, answers: bool, checks: int) -> None:
    server = Answers(answer_from)
    rule = HealthRule(interval_s=0.001, failures_to_fail=failures)
    assert asyncio.run(health.answers_health(server, rule)) is answers  # type: ignore[arg-type]
    assert server.checks == checks


@pytest.mark.parametrize(("options", "rule", "bound_s"), [
    ({}, HealthRule(5.0, 10.0, 3), 45.0),
    ({"rollout_health_check_interval_s": 1, "rollout_health_check_timeout_s": 2, "rollout_health_check_failures": 2},
     HealthRule(1.0, 2.0, 2), 6.0),
], ids=["defaults", "configured"])
def test_the_rule_comes_from_the_job_options(options: dict[str, float], rule: HealthRule, bound_s: float) -> None:
    cfg = load_dict({**BASE, **options})
    spec = rollout_pool_spec(cfg, num_instances=1, kv_cache_bytes=0)
    assert spec.health == rule and spec.health.hang_detection_bound_s == bound_s


@pytest.mark.parametrize("rule", [HealthRule(interval_s=0), HealthRule(timeout_s=-1), HealthRule(failures_to_fail=0)],
                         ids=["no-interval", "negative-timeout", "no-failures"])
def test_a_bad_rule_is_refused_by_the_spec(rule: HealthRule) -> None:
    cfg = load_dict(BASE)
    spec = dataclasses.replace(rollout_pool_spec(cfg, num_instances=1, kv_cache_bytes=0), health=rule)
    assert any(problem.startswith("health.") for problem in spec.problems())


class Host:
    """A host actor's handle whose status call answers, or raises `error` (a host Ray declared gone, one that
    does not answer now)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.calls = 0

    async def acall(self, method: str, *args: object) -> dict[str, object]:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return {"alive": True, "pid": 1}


def test_monitor_fails_only_the_silent_ready_instance() -> None:

    async def scenario() -> dict[str, tuple[str, str]]:
        router = Router(max_concurrent=4, request_timeout_s=5, wait_for_instance_s=0.1)
        for iid, answer_from, state in [("silent", 0, READY), ("fine", 1, READY), ("reloading", 0, RELOADING)]:
            router.slots[iid] = InstanceSlot(id=iid, client=Answers(answer_from), host="h", port=1,  # type: ignore[arg-type]
                                             weight_version=0, state=state, handle=Host())
        task = asyncio.create_task(health.monitor(router, HealthRule(interval_s=0.01)))
        for _ in range(500):  # 3 rounds of 0.01 s, with room for a loaded machine
            await asyncio.sleep(0.01)
            if router.slots["silent"].state == FAILED:
                break
        await asyncio.sleep(0.05)  # more rounds: the others stay as they are
        task.cancel()
        return {iid: (s.state, s.failure) for iid, s in router.slots.items()}

    states = asyncio.run(scenario())
    assert states["silent"] == (FAILED, "/health did not answer 3 checks in a row (10s timeout each)")
    assert states["fine"] == (READY, "") and states["reloading"] == (RELOADING, "")


@pytest.mark.parametrize(("host", "state"), [
    pytest.param(Host(HostGoneError("the host actor rollout-0 is gone (ActorDiedError)")), FAILED,
                 id="host-declared-gone-fails-at-once"),
    pytest.param(Host(HostUnreachableError("does not answer")), READY, id="host-unreachable-is-no-verdict"),
    pytest.param(Host(RuntimeError("status failed")), READY, id="host-error-is-no-verdict"),
    pytest.param(Host(), READY, id="host-answers"),
    pytest.param(None, READY, id="unmanaged-endpoint-has-no-host"),
])
def test_monitor_fails_a_healthy_server_whose_host_is_gone(host: Host | None, state: str) -> None:
    """A node whose Ray daemon hangs is declared dead by Ray while its servers still answer /health: the
    instance is failed from its host's status, in the first round, though its server answers."""

    async def scenario() -> tuple[str, str]:
        router = Router(max_concurrent=4, request_timeout_s=5, wait_for_instance_s=0.1)
        slot = InstanceSlot(id="rollout-0", client=Answers(1), host="h", port=1,  # type: ignore[arg-type]
                            weight_version=0, state=READY, handle=host)
        router.slots[slot.id] = slot
        task = asyncio.create_task(health.monitor(router, HealthRule(interval_s=0.01)))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if slot.state == FAILED or (host is not None and host.calls >= 3) or (host is None and slot.client.checks >= 3):
                break
        task.cancel()
        return slot.state, slot.failure

    found, failure = asyncio.run(scenario())
    assert found == state
    if state == FAILED:
        assert failure.startswith("its host is gone, as when Ray declares its node dead (the host actor rollout-0 is gone")
