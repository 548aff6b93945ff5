"""A per-request reference of an RL job on one rollout instance, against which the engine's per-batch
aggregate is tested: every response's tokens, every decode step, the runtime's admission rule.

What it follows, each as the runtime does it:
- The producer admits one prompt group (`group_size` responses) whenever `libra/controller/batching.py`'s
  rule allows: the step the group would land in (steps consumed + (groups running + groups finished and not
  consumed) // groups per step) is at most `lag` ahead of the weight version the server serves, and the
  running responses stay within `max_concurrent` (`rollouts_in_flight`). Groups are admitted in order; group g
  has the lengths drawn for step g // groups per step.
- The instance runs at most `slots` responses at once, first come first served; a decode step of n running
  responses takes `step_s(n)` and emits one token for each; a finished response frees its slot at once.
  (No KV-cache limit: cases where it binds are `planner.sim.decode.exact_instance_run`'s.)
- A training step consumes the first `groups per step` finished groups, in the order they finished, once
  the previous step has ended, and takes `train_s`; then the server pauses for `sync_s` (an in-place reload:
  running responses wait) and serves the next version when it resumes.

Time moves from one event to the next (a response finishing, a training step ending, a pause ending): between
events the running batch is constant, so the decode steps in between are counted, not stepped. An event that
falls inside a decode step is taken at its own time and the step in progress is not counted (at most one
decode step per event, which the comparisons' tolerance covers).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np


def exact_pipeline_run(step_lengths: Sequence[np.ndarray], group_size: int, lag: int, slots: int,
                       max_concurrent: int, step_s: Callable[[int], float], train_s: float,
                       sync_s: float) -> np.ndarray:
    """End time of every training step. `step_lengths[k]` holds step k's response lengths, group by group."""
    steps = len(step_lengths)
    problems = [text for bad, text in (
        (group_size < 1, f"group_size {group_size}: must be >= 1"),
        (slots < 1, f"slots {slots}: must be >= 1"),
        (lag < 0, f"lag {lag}: must be >= 0"),
        (max_concurrent < group_size, f"max_concurrent {max_concurrent}: must be >= group_size {group_size}"),
        (not steps, "step_lengths: no step")) if bad]
    if problems:
        raise ValueError("; ".join(problems))
    per_step = len(step_lengths[0])
    if per_step % group_size or any(len(lengths) != per_step for lengths in step_lengths):
        raise ValueError(f"every step needs the same number of responses, a multiple of group_size {group_size}")
    groups_per_step = per_step // group_size
    groups = [np.asarray(lengths[i:i + group_size], dtype=np.int64)
              for lengths in step_lengths for i in range(0, per_step, group_size)]

    t, version, consumed, admitted = 0.0, 0, 0, 0
    groups_running = 0
    queue: deque[tuple[int, int]] = deque()  # (group, length) waiting for a slot
    left = np.zeros(len(groups), dtype=np.int64)  # unfinished responses of each group
    run_group = np.zeros(0, dtype=np.int64)
    run_left = np.zeros(0, dtype=np.int64)
    ready: deque[int] = deque()
    train_end = math.inf
    pause_end = -math.inf
    version_at = math.inf
    ends = np.zeros(steps)

    while consumed < steps or train_end < math.inf:
        if version_at <= t:
            version, version_at = version + 1, math.inf
        if train_end <= t:
            ends[consumed - 1] = train_end
            train_end = math.inf
            pause_end = t + sync_s
            version_at = t + sync_s
        if train_end == math.inf and consumed < steps and len(ready) >= groups_per_step:
            for _ in range(groups_per_step):
                ready.popleft()
            consumed += 1
            train_end = t + train_s
        while admitted < len(groups):
            expected = consumed + (groups_running + len(ready)) // groups_per_step
            if expected - version > lag or (groups_running + 1) * group_size > max_concurrent:
                break
            left[admitted] = group_size
            queue.extend((admitted, int(n)) for n in groups[admitted])
            admitted += 1
            groups_running += 1
        if queue and len(run_left) < slots:
            take = [queue.popleft() for _ in range(min(slots - len(run_left), len(queue)))]
            run_group = np.concatenate([run_group, np.array([g for g, _ in take], dtype=np.int64)])
            run_left = np.concatenate([run_left, np.array([n for _, n in take], dtype=np.int64)])

        external = min(train_end, version_at, pause_end if pause_end > t else math.inf)
        if pause_end > t or not len(run_left):
            if external == math.inf:
                raise RuntimeError(f"the reference pipeline stalled at t={t:.1f} s, step {consumed} of {steps}")
            t = external
            continue
        dt = step_s(len(run_left))
        first_finish = int(run_left.min())
        steps_to_event = min(first_finish, int((external - t) / dt)) if external < math.inf else first_finish
        if steps_to_event == 0:
            t = external
            continue
        t += steps_to_event * dt
        run_left -= steps_to_event
        done = run_left == 0
        if done.any():
            for g in run_group[done]:
                left[g] -= 1
                if left[g] == 0:
                    groups_running -= 1
                    ready.append(int(g))
            run_group, run_left = run_group[~done], run_left[~done]
    return ends
