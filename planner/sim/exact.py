"""A per-request reference of an RL job on a pool of rollout instances, against which the engine's per-batch
aggregate is tested: every response's tokens, every decode step, the runtime's admission and routing rules.

What it follows, each as the runtime does it:
- The producer admits one prompt group (`group_size` responses) whenever `libra/controller/batching.py`'s
  rule allows: the step the group would land in (steps consumed + (groups running + groups finished and not
  consumed) // groups per step) is at most `lag` ahead of the weight version the servers serve, and the
  running responses stay within `max_concurrent` (`rollouts_in_flight`). Groups are admitted in order; group g
  has the lengths drawn for step g // groups per step.
- A group is one request (n = `group_size` completions) and goes whole to the instance with the fewest groups
  in flight, ties to the one given the fewest so far, then the first (`libra/rollout/router.py`).
- Each instance runs at most `slots` responses at once, first come first served; a decode step of n running
  responses takes `step_s(n)` and emits one token for each; a finished response frees its slot at once, and
  waiting responses join at the instance's next step boundary. (No KV-cache limit: cases where it binds are
  `planner.sim.decode.exact_instance_run`'s.)
- A training step consumes the first `groups per step` finished groups, in the order they finished, once
  the previous step has ended, and takes `train_s`; then every server pauses for `sync_s` (an in-place reload,
  all instances at once: running responses wait, and a decode step in progress is redone) and serves the next
  version when it resumes.

Time moves from one event to the next (a response finishing, a step boundary where responses wait to join, a
training step ending, a pause ending); each instance keeps the start of its decode step in progress, so between
events its decode steps are counted, not stepped.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class _Instance:
    """One rollout instance: responses waiting for a slot, the running ones (group, tokens left), the start of
    its decode step in progress, and its routing counters."""

    queue: deque[tuple[int, int]] = field(default_factory=deque)
    group: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    left: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    clock: float = 0.0
    outstanding: int = 0
    dispatched: int = 0

    def next_event(self, slots: int, step_s: Callable[[int], float]) -> float:
        if not len(self.left):
            return math.inf
        dt = step_s(len(self.left))
        if self.queue and len(self.left) < slots:
            return self.clock + dt  # waiting responses join at the next step boundary
        return self.clock + int(self.left.min()) * dt

    def advance(self, t: float, step_s: Callable[[int], float]) -> np.ndarray:
        """Run the whole decode steps that end by `t`; the groups of the responses that finished."""
        if not len(self.left):
            return np.zeros(0, dtype=np.int64)
        dt = step_s(len(self.left))
        n = min(int(self.left.min()), math.floor((t - self.clock) / dt + 1e-9))
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        self.clock += n * dt
        self.left -= n
        done = self.left == 0
        finished = self.group[done]
        self.group, self.left = self.group[~done], self.left[~done]
        return finished

    def fill(self, t: float, slots: int) -> None:
        """Let waiting responses take free slots, if the instance is at a step boundary (or idle)."""
        if not self.queue or len(self.left) >= slots:
            return
        if len(self.left) and abs(self.clock - t) > 1e-9 * max(1.0, t):
            return
        if not len(self.left):
            self.clock = t
        take = [self.queue.popleft() for _ in range(min(slots - len(self.left), len(self.queue)))]
        self.group = np.concatenate([self.group, np.array([g for g, _ in take], dtype=np.int64)])
        self.left = np.concatenate([self.left, np.array([n for _, n in take], dtype=np.int64)])


def exact_pipeline_run(step_lengths: Sequence[np.ndarray], group_size: int, lag: int, slots: int,
                       max_concurrent: int, step_s: Callable[[int], float], train_s: float,
                       sync_s: float, instances: int = 1) -> np.ndarray:
    """End time of every training step. `step_lengths[k]` holds step k's response lengths, group by group;
    `slots` and `step_s` are each instance's."""
    steps = len(step_lengths)
    problems = [text for bad, text in (
        (group_size < 1, f"group_size {group_size}: must be >= 1"),
        (slots < 1, f"slots {slots}: must be >= 1"),
        (instances < 1, f"instances {instances}: must be >= 1"),
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

    pool = [_Instance() for _ in range(instances)]
    routed_to = np.zeros(len(groups), dtype=np.int64)
    t, version, consumed, admitted = 0.0, 0, 0, 0
    groups_running = 0
    left = np.zeros(len(groups), dtype=np.int64)  # unfinished responses of each group
    ready: deque[int] = deque()
    train_end = math.inf
    pause_end = -math.inf
    version_at = math.inf
    ends = np.zeros(steps)

    while consumed < steps or train_end < math.inf:
        if pause_end <= t:
            for instance in pool:
                for g in instance.advance(t, step_s):
                    left[g] -= 1
                    if left[g] == 0:
                        groups_running -= 1
                        pool[routed_to[g]].outstanding -= 1
                        ready.append(int(g))
        if version_at <= t:
            version, version_at = version + 1, math.inf
        if train_end <= t:
            ends[consumed - 1] = train_end
            train_end = math.inf
            pause_end = t + sync_s
            version_at = t + sync_s
            if sync_s > 0:
                for instance in pool:
                    instance.clock = pause_end
        if train_end == math.inf and consumed < steps and len(ready) >= groups_per_step:
            for _ in range(groups_per_step):
                ready.popleft()
            consumed += 1
            train_end = t + train_s
        while admitted < len(groups):
            expected = consumed + (groups_running + len(ready)) // groups_per_step
            if expected - version > lag or (groups_running + 1) * group_size > max_concurrent:
                break
            target = min(range(instances), key=lambda i: (pool[i].outstanding, pool[i].dispatched, i))
            routed_to[admitted] = target
            pool[target].outstanding += 1
            pool[target].dispatched += 1
            left[admitted] = group_size
            pool[target].queue.extend((admitted, int(n)) for n in groups[admitted])
            admitted += 1
            groups_running += 1
        paused = pause_end > t
        if not paused:
            for instance in pool:
                instance.fill(t, slots)

        external = min(train_end, version_at, pause_end if paused else math.inf)
        internal = math.inf if paused else min(instance.next_event(slots, step_s) for instance in pool)
        if min(external, internal) == math.inf:
            raise RuntimeError(f"the reference pipeline stalled at t={t:.1f} s, step {consumed} of {steps}")
        t = min(external, internal)
    return ends
