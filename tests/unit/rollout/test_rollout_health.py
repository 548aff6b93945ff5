"""The health rule: an instance has failed only after HEALTH_FAILURES_TO_FAIL checks in a row got no answer; the
monitor applies it to READY instances only (a reloading or starting server may not answer for a while)."""

from __future__ import annotations

import asyncio

import pytest

from libra.rollout import health
from libra.rollout.router import FAILED, READY, RELOADING, InstanceSlot, Router


class Answers:
    """A server whose /health answers from the `answer_from`-th check on (0 = never)."""

    def __init__(self, answer_from: int) -> None:
        self.answer_from = answer_from
        self.checks = 0

    async def health(self, timeout_s: float = 5.0) -> bool:
        self.checks += 1
        return 0 < self.answer_from <= self.checks


@pytest.mark.parametrize(("answer_from", "answers", "checks"), [(1, True, 1), (3, True, 3), (4, False, 3), (0, False, 3)],
                         ids=["at-once", "at-the-last-check", "too-late", "never"])
def test_answers_health(monkeypatch: pytest.MonkeyPatch, answer_from: int, answers: bool, checks: int) -> None:
    monkeypatch.setattr(health, "HEALTH_INTERVAL_S", 0.0)
    server = Answers(answer_from)
    assert asyncio.run(health.answers_health(server)) is answers  # type: ignore[arg-type]
    assert server.checks == checks


def test_monitor_fails_only_the_silent_ready_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(health, "HEALTH_INTERVAL_S", 0.01)

    async def scenario() -> dict[str, tuple[str, str]]:
        router = Router(max_concurrent=4, request_timeout_s=5, wait_for_instance_s=0.1)
        for iid, answer_from, state in [("silent", 0, READY), ("fine", 1, READY), ("reloading", 0, RELOADING)]:
            router.slots[iid] = InstanceSlot(id=iid, client=Answers(answer_from), host="h", port=1,  # type: ignore[arg-type]
                                             weight_version=0, state=state)
        task = asyncio.create_task(health.monitor(router))
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
