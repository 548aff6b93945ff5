"""The accounting of one rollout-pool switch, as pure functions over what was recorded during it: the pool's
sampled instance table (who was alive, on how many GPUs, READY and serving) and every prompt's outcomes.

- `pool_accounting`: seconds with no READY serving instance, GPU-seconds of instances alive but not serving
  READY, which instances were started, stopped or left alone, and when the final serving set took over;
- `prompt_accounting`: requests that failed (not requeue-able), prompts lost (no completion in the end) and
  prompts completed more than once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

COMPLETED = "completed"
REQUEUED = "requeued"  # aborted by a non-drained stop: the prompt goes back to the producer
FAILED = "failed"  # any other error: the request failed and its prompt is not retried
OUTCOMES = (COMPLETED, REQUEUED, FAILED)


@dataclass(frozen=True)
class InstanceSample:
    """One instance as the pool reported it at one sample."""

    id: str
    pid: int
    state: str  # starting | ready | reloading | draining | failed | stopped
    serving: bool
    gpus: int

    @property
    def serves(self) -> bool:
        return self.serving and self.state == "ready"


@dataclass(frozen=True)
class PoolSample:
    """The pool's instance table at time `t` (seconds, any monotonic origin)."""

    t: float
    instances: tuple[InstanceSample, ...]


@dataclass(frozen=True)
class PoolFigures:
    rollout_unavailable_s: float
    gpu_idle_s: float
    instances_started: int
    instances_stopped: int
    instances_unchanged: int
    serving_flip_s: float  # from the start to the first sample serving the final serving set (READY)


@dataclass(frozen=True)
class PromptFigures:
    prompts: int
    requests_failed: int
    requests_requeued: int
    samples_lost: int
    samples_duplicated: int


def pool_accounting(samples: Sequence[PoolSample], start: float, end: float) -> PoolFigures:
    """Figures of the switch from `start` to `end`. Each sample holds until the next one (the last until
    `end`); samples before `start` give the pool as it was when the switch began. An instance whose pid
    changed under its id counts as stopped (it was not left alone); ids the pool had not shown before
    `start` count as started."""
    if end < start:
        raise ValueError(f"end={end} is before start={start}: pass the switch's start and end times in order")
    ordered = sorted(samples, key=lambda s: s.t)
    before = [s for s in ordered if s.t <= start]
    during = [s for s in ordered if start < s.t <= end]
    if not before:
        raise ValueError(f"no sample at or before start={start}: sample the pool before the switch begins")
    timeline = [PoolSample(start, before[-1].instances), *during]
    unavailable = 0.0
    idle = 0.0
    for sample, following in zip(timeline, [*timeline[1:], PoolSample(end, ())], strict=True):
        held = following.t - sample.t
        if not any(i.serves for i in sample.instances):
            unavailable += held
        idle += held * sum(i.gpus for i in sample.instances if i.state != "stopped" and not i.serves)
    first = {i.id: i.pid for i in timeline[0].instances if i.state != "stopped"}
    last = {i.id: i.pid for i in timeline[-1].instances if i.state != "stopped"}
    seen = {i.id for s in timeline for i in s.instances}
    unchanged = {instance_id for instance_id, pid in first.items() if last.get(instance_id) == pid}
    final_serving = _serving(timeline[-1])
    flipped_at = next(s.t for s in timeline if _serving(s) == final_serving)
    return PoolFigures(
        rollout_unavailable_s=round(unavailable, 3),
        gpu_idle_s=round(idle, 3),
        instances_started=len(seen - set(first)),
        instances_stopped=len(set(first) - unchanged),
        instances_unchanged=len(unchanged),
        serving_flip_s=round(flipped_at - start, 3),
    )


def _serving(sample: PoolSample) -> frozenset[str]:
    return frozenset(i.id for i in sample.instances if i.serves)


def prompt_accounting(outcomes: Mapping[int, Sequence[str]]) -> PromptFigures:
    """Figures of a request stream from each prompt's outcomes in order (completed / requeued / failed)."""
    for prompt, events in outcomes.items():
        unknown = [e for e in events if e not in OUTCOMES]
        if unknown:
            raise ValueError(f"prompt {prompt}: outcome(s) {unknown} unknown; use one of {OUTCOMES}")
    completions = {prompt: sum(1 for e in events if e == COMPLETED) for prompt, events in outcomes.items()}
    return PromptFigures(
        prompts=len(outcomes),
        requests_failed=sum(1 for events in outcomes.values() for e in events if e == FAILED),
        requests_requeued=sum(1 for events in outcomes.values() for e in events if e == REQUEUED),
        samples_lost=sum(1 for count in completions.values() if count == 0),
        samples_duplicated=sum(1 for count in completions.values() if count > 1),
    )
