"""Desired and observed state of a job: what the controller wants (checkpointed in the run directory) and
what it saw on the last tick (rebuilt from what is running, never checkpointed).

The reconciler compares the two; nothing here has side effects apart from `DesiredState.save`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libra.controller.members import Member, MemberState
from libra.run_dir import CorruptRunStateError, write_json_atomic
from planner.layout import TrainLayout

ROLLOUT = "rollout"
TRAIN = "train"


@dataclass(frozen=True)
class RolloutSpec:
    """What makes one rollout instance: its TP degree and the fingerprint of its launch settings (model,
    dtype, KV cache, ...). Two instances with equal specs are interchangeable; a member whose spec differs
    from the desired one is outdated and is replaced by the reconfigure strategy."""

    tp: int
    fingerprint: str = ""

    def differs_from(self, other: RolloutSpec) -> list[str]:
        """What differs (empty = same). An unknown fingerprint (adopted from a pool that does not report
        one) is taken as matching: only a known difference makes an instance outdated."""
        changes = []
        if self.tp != other.tp:
            changes.append(f"TP {self.tp} -> {other.tp}")
        if self.fingerprint and other.fingerprint and self.fingerprint != other.fingerprint:
            changes.append(f"launch settings {self.fingerprint[:8]} -> {other.fingerprint[:8]}")
        return changes


@dataclass(frozen=True)
class DesiredState:
    """What the job should look like. Every change bumps `generation` and is checkpointed."""

    rollout_instances: int
    rollout_tp: int
    train_gpus: int
    train_layout: TrainLayout
    weight_version: int = 0
    # The rollout pool only accepts increasing publish versions. After a resume from a checkpoint older than
    # the weights adopted servers hold, policy version v is published as v + offset (and mapped back).
    rollout_version_offset: int = 0
    reconfigure_strategy: str = "diff"
    drain_before_stop: bool = True
    rollout_fingerprint: str = ""  # launch settings of every rollout instance (RolloutSpec.fingerprint)
    cluster_gpus: int = 0  # every GPU of the cluster (0 = unknown: no spare GPUs are assumed)
    cluster_swap_enabled: bool = False  # runtime_cluster_swap_enabled
    # prewarm: the target instances are started and kept on current weights; serving flips once this is set
    switch_now: bool = True
    reconfiguring: str = ""  # the reconfiguration in progress ("" = none), as the event log names it
    # the last training-pool change decided but not carried out (runtime_training_pool_plan_only; "" = none)
    planned_training: str = ""
    generation: int = 0
    reason: str = ""
    updated_at: float = 0.0

    @property
    def rollout_gpus(self) -> int:
        return self.rollout_instances * self.rollout_tp

    @property
    def rollout_spec(self) -> RolloutSpec:
        return RolloutSpec(self.rollout_tp, self.rollout_fingerprint)

    @property
    def publish_version(self) -> int:
        """The weight version every serving rollout instance must hold (policy version + offset)."""
        return self.weight_version + self.rollout_version_offset

    def evolve(self, reason: str, **changes: Any) -> DesiredState:
        """A new desired state with `changes`, the next generation and the time of the change."""
        return dataclasses.replace(
            self, generation=self.generation + 1, reason=reason, updated_at=time.time(), **changes
        )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rollout_gpus"] = self.rollout_gpus
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DesiredState:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["train_layout"] = TrainLayout(**values.get("train_layout", {}))
        return cls(**values)

    def save(self, path: Path) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: Path) -> DesiredState | None:
        """The checkpointed desired state; None when there is none; CorruptRunStateError naming the file when
        it is damaged (it is not replaced silently: it may hold a resize the configuration does not)."""
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _corrupt(path, f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(data, dict):
            raise _corrupt(path, f"it holds {type(data).__name__}, not an object")
        try:
            desired = cls.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise _corrupt(path, str(exc)) from exc
        problems = desired.problems()
        if problems:
            raise _corrupt(path, "; ".join(problems))
        return desired

    def problems(self) -> list[str]:
        """What no desired state may hold (counts that are not positive integers, negative versions)."""
        positive = {"rollout_tp": self.rollout_tp}
        counters = {"train_gpus": self.train_gpus, "rollout_instances": self.rollout_instances,
                    "weight_version": self.weight_version, "generation": self.generation}
        bad = [f"{k}={v!r} (must be an integer >= 1)" for k, v in positive.items() if not _is_int(v) or v < 1]
        bad += [f"{k}={v!r} (must be an integer >= 0)" for k, v in counters.items() if not _is_int(v) or v < 0]
        return bad


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _corrupt(path: Path, why: str) -> CorruptRunStateError:
    return CorruptRunStateError(
        f"{path} is damaged ({why}); restore it, or delete it and the launch plans the allocation again from "
        "the configuration (the run's checkpoints are kept)")


@dataclass(frozen=True)
class PoolObservation:
    """A pool as a whole: created or not, an action on it in flight, the last error of an action on it."""

    created: bool = False
    busy: bool = False
    error: str = ""
    size: int = 0  # GPUs (train) or instances (rollout) it was created with
    retry_at: float = 0.0  # after failed actions on this pool, no new action before this time
    # after members failed soon after becoming READY (a crash loop), no new member starts before this time
    start_after: float = 0.0


@dataclass(frozen=True)
class ObservedState:
    """One tick's view: pools, members (copies), and the time the observation was taken."""

    now: float
    rollout: PoolObservation = PoolObservation()
    train: PoolObservation = PoolObservation()
    members: tuple[Member, ...] = ()
    errors: tuple[str, ...] = field(default_factory=tuple)  # action errors since the last tick

    def of(self, pool: str) -> list[Member]:
        return [m for m in self.members if m.pool == pool]

    def live(self, pool: str) -> list[Member]:
        return [m for m in self.of(pool) if m.live]

    def in_state(self, pool: str, *states: MemberState) -> list[Member]:
        return [m for m in self.of(pool) if m.state in states]

    def ready_count(self, pool: str) -> int:
        return len(self.in_state(pool, MemberState.READY))
