"""Continuous-batching decode of one rollout instance with a KV-cache limit: exact per request, and the
per-batch aggregate the simulator uses.

A vLLM-style instance runs at most `max_seqs` sequences at once and holds their KV cache in a fixed token
budget (`kv_tokens`, paged: a sequence holds prompt + generated tokens so far). Every decode step emits one
token for every running sequence; a finished sequence frees its slot and its KV blocks at once, and the
next waiting request is admitted (first come, first served). When the KV cache would overflow, the most
recently admitted sequence is preempted and recomputed later (vLLM's default preemption mode, recompute).

`exact_instance_run` steps through every decode step (for tests and small cases). The simulator uses the
aggregate of `instance_generation`, which needs only a batch's count, total, longest and E[L^2]/E[L]:

- slots: C = min(max_seqs, requests, kv_tokens / (prompt + E[L^2] / (2 E[L]))): a slot holds, at a random
  moment, a request picked with probability proportional to its length (length-biased sampling), half of
  whose response is generated on average, so the KV cache caps concurrency at its token budget divided by
  that mean live context.
- bulk: while requests wait, all C slots decode: T / C - r steps, where T is the instance's response tokens
  and r = E[L^2] / (2 E[L]) the mean residual length of a running request (renewal theory), i.e. the work
  the running requests still hold when the queue empties.
- drain: the queue is empty and the last requests finish. The whole run is taken as
  max(L_max, T / C + (L_max - r) / 2) steps: the longest request starts on average half-way through its
  share of the drain (an empirical fit to `exact_instance_run` over log-normal lengths, sigma 0.5-1.0, 64 to
  2,000 requests, 16 to 128 slots: within about +-10%, worst case about 20%). Each drain step runs the
  requests not yet finished, so the drain's sequence-steps add up to the tokens left when the queue empties
  (T - bulk x C, about C x r; all T when n <= C, where every request starts at once and the run is L_max
  steps): the drain steps run at the step time of that many tokens over the drain's steps (`drain_batch`;
  exact when a step's time is affine in its batch and the step count is right). A long tail thus drains at
  the step time of the few requests left, not of a half-full batch.

Streaming (asynchronous runs, `instance_generation(..., streaming=True)`): requests of the next steps fill
the slots too (the admission window of `max_head_offpolicyness`), and a step's requests take their share of the pool's work:
T / C steps, of which the last r are done while the next step's requests are admitted (they carry over); if
admission is closed when the step's requests are all admitted, the drain is exposed as above. The slots are
counted over the part of the window that holds running responses (`streaming_window`): the runtime
(`libra/controller/batching.py`) admits whole prompt groups and counts a group against the window from its
admission until a training step takes it, so (a) a group whose shorter responses have finished still holds
room for all of them until its longest finishes: over a group's life its size x `BatchStats.group_fill` of
its responses run; (b) finished groups wait for a step to take them, a batch at a time: half a batch on
average, so a lag of s offers s + 1/2 batches of room, not s + 1; (c) from a training step's start until the
weights it makes serve, the step has taken its groups and the version has not moved, so the window is one
batch smaller: that share of the time (the engine takes it from the step before) an instance has s - 1/2
batches of room, the rest s + 1/2, each phase capped by the slots on its own (`streaming_slots`), since a
window that binds only while training still costs throughput there.

The aggregate's error against `exact_instance_run` is checked by tests/unit/planner/test_sim_decode.py, and
the engine's step times against the per-request pipeline of `planner.sim.exact` by
tests/unit/planner/test_sim_exact.py.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ExactRun:
    """What `exact_instance_run` measured: seconds, decode steps, largest batch, preemptions."""

    seconds: float
    steps: int
    max_running: int
    preemptions: int


def exact_instance_run(lengths: Sequence[int], prompt: int, max_seqs: int, kv_tokens: int,
                       step_s: Callable[[int], float]) -> ExactRun:
    """Decode `lengths` (response tokens, FCFS order) on one instance, one decode step at a time."""
    if max_seqs < 1:
        raise ValueError(f"max_seqs {max_seqs}: must be >= 1")
    if any(prompt + length > kv_tokens for length in lengths):
        raise ValueError(f"kv_tokens {kv_tokens}: a request of prompt {prompt} + {max(lengths)} tokens never fits")
    waiting: deque[tuple[int, int]] = deque((i, int(n)) for i, n in enumerate(lengths))
    running: list[list[int]] = []  # [request id, length, generated]
    seconds, steps, widest, preemptions = 0.0, 0, 0, 0
    while waiting or running:
        while waiting and len(running) < max_seqs:
            used = sum(prompt + r[2] for r in running)
            rid, length = waiting[0]
            if used + prompt + 1 > kv_tokens:
                break
            waiting.popleft()
            running.append([rid, length, 0])
        # the next step adds one token to every running sequence; preempt the newest until it fits
        while sum(prompt + r[2] + 1 for r in running) > kv_tokens:
            rid, length, _ = running.pop()
            waiting.appendleft((rid, length))
            preemptions += 1
        widest = max(widest, len(running))
        seconds += step_s(len(running))
        steps += 1
        for r in running:
            r[2] += 1
        running = [r for r in running if r[2] < r[1]]
    return ExactRun(seconds, steps, widest, preemptions)


def slots(max_seqs: int, kv_tokens: float, prompt: float, length_biased_mean: float, requests: float) -> int:
    """Sequences an instance runs at once: vLLM's cap, the KV-cache budget at the mean live context, and the
    requests it has (a mean may be fractional: whole sequences)."""
    live_context = prompt + length_biased_mean / 2.0
    by_kv = math.floor(kv_tokens / live_context) if live_context > 0 else max_seqs
    return max(1, min(max_seqs, by_kv, math.floor(requests)))


def streaming_window(requests: int, lag: int, group_fill: float) -> float:
    """Responses of one instance's admission window that are running on average, under a policy lag of
    `lag` >= 1 steps with `requests` responses per step (the module's streaming rule)."""
    return max(1.0, requests * (lag + 0.5) * group_fill)


def streaming_slots(max_seqs: int, kv_tokens: float, prompt: float, length_biased_mean: float, requests: int,
                    lag: int, group_fill: float, training_share: float) -> int:
    """Sequences an instance runs at once on average under a policy lag of `lag` >= 1: the room of the window
    that runs is one batch smaller while a training step and its reload are in progress (the step has taken
    its groups, the weights it makes do not serve yet), `training_share` of the time, and each phase is capped
    by the slots on its own (so a window that binds only while training still costs throughput)."""
    def phase(batches: int) -> int:
        return slots(max_seqs, kv_tokens, prompt, length_biased_mean, streaming_window(requests, batches, group_fill))

    if training_share <= 0.0:
        return phase(lag)
    return max(1, round(training_share * phase(lag - 1) + (1.0 - training_share) * phase(lag)))


def decode_steps(requests: int, total_tokens: float, longest: float, length_biased_mean: float, slot_count: int,
                 streaming: bool = False) -> tuple[float, float]:
    """(bulk, drain) decode steps of one instance's share of a batch (the module's formulas). Streaming: the
    slots are counted over the admission window, so the step's own requests may be fewer than the slots."""
    if requests <= slot_count and not streaming:
        return 0.0, float(longest)
    residual = length_biased_mean / 2.0
    full = total_tokens / slot_count
    bulk = max(0.0, full - residual)
    return bulk, max(float(longest), full + (float(longest) - residual) / 2.0) - bulk


def drain_batch(total_tokens: float, slot_count: int, bulk_steps: float, drain_steps: float) -> float:
    """Mean sequences a decode step runs during the drain: the tokens left when the queue empties (all of them
    when every request starts at once) over the drain's steps, since each drain step runs the unfinished
    requests, so the steps' batches add up to those tokens."""
    if drain_steps <= 0:
        return 1.0
    return max(1.0, min(float(slot_count), (total_tokens - bulk_steps * slot_count) / drain_steps))


@dataclass(frozen=True)
class InstanceRun:
    """Aggregate decode of one step's requests on one instance. `drain_work_s` is the part of the drain a
    full batch would do (the running requests' residual tokens), which the next step's requests overlap when
    they may start (streaming: `drain_s` is then the drain exposed when admission is closed)."""

    slots: int
    bulk_steps: float
    drain_steps: float
    drain_batch: float
    step_full_s: float
    bulk_s: float
    drain_s: float
    drain_work_s: float


def instance_generation(requests: int, total_tokens: float, longest: float, length_biased_mean: float,
                        slot_count: int, step_s: Callable[[float], float], streaming: bool = False) -> InstanceRun:
    """Aggregate continuous-batching decode of `requests` responses of `total_tokens` on one instance, a
    decode step at n running sequences taking `step_s(n)` seconds. Streaming: the slots are kept full by the
    requests of the admission window (the module's streaming rule)."""
    bulk, drain = decode_steps(requests, total_tokens, longest, length_biased_mean, slot_count, streaming)
    batch = drain_batch(total_tokens, slot_count, bulk, drain)
    step_full_s, step_drain_s = step_s(slot_count), step_s(batch)
    residual_work = (total_tokens / slot_count - bulk) * step_full_s
    if streaming:
        drain_work = residual_work
    else:
        drain_work = 0.0 if requests <= slot_count else min(drain * step_drain_s, residual_work)
    return InstanceRun(slot_count, bulk, drain, batch, step_full_s, bulk * step_full_s, drain * step_drain_s,
                       drain_work)
