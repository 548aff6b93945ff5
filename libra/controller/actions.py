"""The actions the reconciler plans and the executor performs: one frozen dataclass per kind of change.

Every action names what it touches by member id (one id space, made by `members.next_member_ids`) and
carries a `reason` for the event log. Rollout membership actions follow the transition table: a started
instance receives no traffic until `SetServing` names it, and `SetServing` only names instances that hold
the current weights (`PublishWeights` first).
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.controller.state import RolloutSpec, TrainLayout


@dataclass(frozen=True)
class Action:
    """Base of all actions; `reason` is what the event log shows."""

    reason: str

    @property
    def kind(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class CreateRolloutPool(Action):
    """Create the rollout pool with `num_instances` (live servers in the registry are adopted); they serve."""

    num_instances: int
    member_ids: tuple[str, ...]
    spec: RolloutSpec = RolloutSpec(tp=1)
    generation: int = 0


@dataclass(frozen=True)
class StartRolloutInstance(Action):
    """Start one instance with `spec` under `member_id` (also its instance id); it does not serve yet."""

    member_id: str
    spec: RolloutSpec
    generation: int = 0


@dataclass(frozen=True)
class StopRolloutInstance(Action):
    """Stop one instance: `drain` finishes its in-flight requests, otherwise they are aborted and requeued."""

    member_id: str
    drain: bool


@dataclass(frozen=True)
class PublishWeights(Action):
    """Load publish version `version` into `member_ids` (validated by their ACKs)."""

    version: int
    member_ids: tuple[str, ...]


@dataclass(frozen=True)
class SetServing(Action):
    """Route traffic to exactly `member_ids` (one atomic flip)."""

    member_ids: tuple[str, ...]


@dataclass(frozen=True)
class CreateTrainingPool(Action):
    gpus: int
    layout: TrainLayout
    member_ids: tuple[str, ...]


@dataclass(frozen=True)
class ShrinkTrainingPool(Action):
    """Give `gpus` GPUs of the training pool to the rollout pool (cluster_swap), at a step boundary."""

    gpus: int


@dataclass(frozen=True)
class ResizeTrainingPool(Action):
    """Move the training pool to `gpus` GPUs under `layout` at a step boundary (save -> stop -> start ->
    load, resharded); its ranks become the members `member_ids` and the old ones stop."""

    gpus: int
    layout: TrainLayout
    member_ids: tuple[str, ...]
    generation: int = 0


@dataclass(frozen=True)
class MarkFailed(Action):
    member_id: str


@dataclass(frozen=True)
class StrategyFallback(Action):
    """Nothing to perform: the strategy could not run as asked and `used` runs instead (event log only)."""

    strategy: str
    used: str
