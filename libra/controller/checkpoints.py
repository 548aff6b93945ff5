"""Job checkpoints: the training pool's checkpoint plus the controller's own state (step, policy version,
position in the prompt stream, running totals), with retention.

`checkpoints/step_NNNNNN/train/` is written by the training pool; `controller_state.json` is written
last and atomically, so a checkpoint without it (a crash mid-save) is ignored on resume.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libra.run_dir import CONTROLLER_STATE, RunDir, read_json, write_json_atomic

TRAIN_SUBDIR = "train"


@dataclass
class ControllerState:
    """What the controller needs, besides the model, to continue a run exactly where it stopped."""

    step: int = 0  # completed training steps (= policy version of the trainer)
    prompts_drawn: int = 0
    discarded_groups: int = 0
    discarded_samples: int = 0
    rollout_failures: int = 0
    train_seconds: float = 0.0  # wall time of all previous sessions' step loops
    sessions: int = 0
    best_eval_accuracy: float | None = None
    saved_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ControllerState:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def retained_steps(steps: list[int], keep_last: int, keep_every: int) -> set[int]:
    """Steps to keep: the newest `keep_last` (0 = all) and every multiple of `keep_every` (0 = none)."""
    keep = set(steps if keep_last <= 0 else steps[-keep_last:])
    if keep_every > 0:
        keep |= {s for s in steps if s % keep_every == 0}
    return keep


class CheckpointStore:
    def __init__(self, run: RunDir, keep_last: int, keep_every: int) -> None:
        self.run = run
        self.keep_last = keep_last
        self.keep_every = keep_every

    def train_dir(self, step: int) -> Path:
        return self.run.checkpoint_dir(step) / TRAIN_SUBDIR

    def begin(self, step: int) -> Path:
        """The folder the training pool writes step `step` into (an unfinished earlier try is removed)."""
        folder = self.run.checkpoint_dir(step)
        if folder.exists() and not (folder / CONTROLLER_STATE).is_file():
            shutil.rmtree(folder, ignore_errors=True)
        path = self.train_dir(step)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def commit(self, state: ControllerState) -> Path:
        state.saved_at = time.time()
        folder = self.run.checkpoint_dir(state.step)
        write_json_atomic(folder / CONTROLLER_STATE, state.to_dict())
        self.prune()
        return folder

    def prune(self) -> list[int]:
        found = self.run.checkpoints_by_step()
        keep = retained_steps([s for s, _ in found], self.keep_last, self.keep_every)
        removed = []
        for step, path in found:
            if step not in keep:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(step)
        return removed

    def latest(self) -> tuple[ControllerState, Path] | None:
        found = self.run.latest_checkpoint()
        if found is None:
            return None
        _, folder = found
        data = read_json(folder / CONTROLLER_STATE)
        if data is None:
            return None
        return ControllerState.from_dict(data), folder / TRAIN_SUBDIR
