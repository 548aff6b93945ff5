"""The reconfigure benchmark's accounting of a switch from a recorded pool timeline and prompt outcomes."""

from __future__ import annotations

import pytest
from benchmark_modules import load_benchmark_module

acc = load_benchmark_module("reconfigure_accounting")


def inst(instance_id: str, state: str = "ready", serving: bool = True, pid: int = 0, gpus: int = 1) -> object:
    return acc.InstanceSample(instance_id, pid or 100 + int(instance_id[-1]), state, serving, gpus)


def timeline(*rows: tuple[float, tuple[object, ...]]) -> list[object]:
    return [acc.PoolSample(t, instances) for t, instances in rows]


BLUE = (inst("r0"), inst("r1"))

POOL_CASES = [
    pytest.param(
        timeline((0.0, BLUE), (1.0, (*BLUE, inst("r2", "starting", False, pid=-1))),
                 (3.0, (*BLUE, inst("r2", "ready", False))), (4.0, (*BLUE, inst("r2")))),
        0.0, 5.0, (0.0, 3.0, 1, 0, 2, 4.0), id="diff-grow: one started, idle while starting and loading"),
    pytest.param(
        timeline((0.0, BLUE), (1.0, (inst("r0", "draining", False), inst("r1", "draining", False))),
                 (2.0, ()), (4.0, (inst("r2", "starting", False), inst("r3", "starting", False))),
                 (6.0, (inst("r2"), inst("r3")))),
        0.5, 7.0, (5.0, 2.0 + 4.0, 2, 2, 0, 5.5), id="restart_all: unavailable from the stop to the new set"),
    pytest.param(
        timeline((0.0, BLUE), (1.0, (*BLUE, inst("r2", "ready", False), inst("r3", "ready", False))),
                 (2.0, (inst("r0", "draining", False), inst("r1", "draining", False), inst("r2"), inst("r3"))),
                 (3.0, (inst("r2"), inst("r3")))),
        0.0, 3.0, (0.0, 2.0 + 2.0, 2, 2, 0, 2.0), id="blue_green: never unavailable, green and drain idle"),
    pytest.param(
        timeline((0.0, BLUE), (1.0, (inst("r0", pid=999), inst("r1")))),
        0.0, 2.0, (0.0, 0.0, 0, 1, 1, 0.0), id="a new pid under an old id is not unchanged"),
    pytest.param(
        timeline((0.0, (inst("r0", gpus=2),)), (1.0, (inst("r0", gpus=2), inst("r1", "starting", False, gpus=2)))),
        0.0, 1.5, (0.0, 1.0, 1, 0, 1, 0.0), id="idle GPU-seconds count every GPU of an instance"),
]


@pytest.mark.parametrize(("samples", "start", "end", "expected"), POOL_CASES)
def test_pool_accounting(samples: list[object], start: float, end: float,
                         expected: tuple[float, float, int, int, int, float]) -> None:
    f = acc.pool_accounting(samples, start, end)
    assert (f.rollout_unavailable_s, f.gpu_idle_s, f.instances_started, f.instances_stopped,
            f.instances_unchanged, f.serving_flip_s) == pytest.approx(expected)


@pytest.mark.parametrize(("samples", "start", "end", "match"), [
    pytest.param(timeline((1.0, BLUE)), 0.0, 2.0, "no sample at or before start", id="no-sample-before"),
    pytest.param(timeline((0.0, BLUE)), 2.0, 1.0, "is before start", id="end-before-start"),
])
def test_pool_accounting_refuses(samples: list[object], start: float, end: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        acc.pool_accounting(samples, start, end)


C, Q, F = acc.COMPLETED, acc.REQUEUED, acc.FAILED


@pytest.mark.parametrize(("outcomes", "expected"), [
    pytest.param({0: [C], 1: [C]}, (2, 0, 0, 0, 0), id="all-completed"),
    pytest.param({0: [Q, C], 1: [C]}, (2, 0, 1, 0, 0), id="requeue-then-completion-is-not-lost"),
    pytest.param({0: [Q], 1: [C]}, (2, 0, 1, 1, 0), id="requeued-never-completed-is-lost"),
    pytest.param({0: [F], 1: [C]}, (2, 1, 0, 1, 0), id="failed-is-lost"),
    pytest.param({0: [C, Q, C]}, (1, 0, 1, 0, 1), id="completed-twice-is-duplicated"),
])
def test_prompt_accounting(outcomes: dict[int, list[str]], expected: tuple[int, int, int, int, int]) -> None:
    f = acc.prompt_accounting(outcomes)
    assert (f.prompts, f.requests_failed, f.requests_requeued, f.samples_lost, f.samples_duplicated) == expected


def test_prompt_accounting_refuses_an_unknown_outcome() -> None:
    with pytest.raises(ValueError, match="prompt 3: outcome"):
        acc.prompt_accounting({3: ["timeout"]})
