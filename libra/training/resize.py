"""What a training-pool resize or re-layout costs, and how it failed when it did.

A resize runs at a step boundary through the checkpoint path (`TrainingPool.relayout`): save the model,
optimizer, scheduler and RNG state with Megatron-Core distributed checkpointing -> stop the workers ->
start the workers at the new GPU count and layout -> load (resharded by `dist_checkpointing`). Each phase
is timed; the first optimizer step after the change is timed too, once it has run. `ResizeCost` is the
record the event log and the switch-cost log (`libra.controller.switch_costs`) keep, so the online re-planner
can learn what a change of the training pool costs.

What continues unchanged: the learning-rate schedule (scheduler state in the checkpoint), the data order
(the controller's, not the pool's: the pool trains on whatever batch it is given, split over its DP ranks),
and the step count. RNG state is restored per rank when the layout is unchanged and re-derived from
(seed, step) when it changes (`libra.training.checkpoint.load`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

PHASES = ("save", "stop", "start", "load")


@dataclass
class ResizeCost:
    """One resize of the training pool with the measured seconds of each phase. `first_step_s` is the
    duration of the first optimizer step at the new layout (None until it ran); `recovered` says that the
    pool was down (an earlier attempt failed) and was started from the newest consistent checkpoint instead
    of saving first."""

    from_gpus: int
    from_layout: dict[str, int]
    to_gpus: int
    to_layout: dict[str, int]
    step: int
    checkpoint: str
    save_s: float = 0.0
    stop_s: float = 0.0
    start_s: float = 0.0
    load_s: float = 0.0
    switch_s: float = 0.0
    first_step_s: float | None = None
    recovered: bool = False

    @property
    def label(self) -> str:
        return f"{describe(self.from_gpus, self.from_layout)} -> {describe(self.to_gpus, self.to_layout)}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "label": self.label}


def describe(gpus: int, dims: dict[str, int]) -> str:
    """`4 GPUs TP2 PP1 CP1 EP1 DP2` from a layout's `dims`."""
    if not dims:
        return f"{gpus} GPUs (not running)"
    return (f"{gpus} GPUs TP{dims.get('tp', 1)} PP{dims.get('pp', 1)} CP{dims.get('cp', 1)} "
            f"EP{dims.get('ep', 1)} DP{dims.get('dp', 1)}")


class TrainingResizeError(RuntimeError):
    """A resize failed in `phase`. After a failed save the pool's in-memory state is gone and the newest
    consistent checkpoint is an older one; after a failed stop, start or load the resize checkpoint is
    complete and `TrainingPool.relayout` (called again) resumes from it."""

    def __init__(self, phase: str, checkpoint_root: str, cause: BaseException) -> None:
        self.phase = phase
        self.checkpoint_root = checkpoint_root
        lost = phase in ("save", "resume")
        then = ("the newest consistent checkpoint under it is from before this resize; resume the job from its "
                "checkpoint" if lost else "the resize checkpoint there is complete; relayout again to resume from it")
        super().__init__(f"training pool resize failed while it would {phase} ({type(cause).__name__}: {cause}); "
                         f"checkpoints in {checkpoint_root}: {then}")
