"""The run directory of one job: where every artefact of a run lives, and the few helpers that read it back.

```
<run_dir>/
  config.yaml            resolved configuration (what actually ran, defaults filled in)
  plan.json              the initial allocation (planner output or the pinned split)
  desired_state.json     the controller's desired state (checkpointed on every change)
  status.json            live status, rewritten every step (read by `libra status`)
  metrics.jsonl          one JSON object per training step
  events.jsonl           controller event log (transitions, actions, errors)
  learning_curve.png     reward per step (updated periodically and at the end)
  controller.log         controller log file
  checkpoints/step_000010/{train/, controller_state.json}
  traces/                phase traces (phase_trace_rank*.jsonl)
  weights/v000010/       the HF export published to the rollout servers
  rollout/               the rollout pool's registry and server logs
  training/              the training pool's scratch space
```

A checkpoint is complete only when its `controller_state.json` exists: it is written last, atomically.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECKPOINT_PREFIX = "step_"
WEIGHTS_PREFIX = "v"
CONTROLLER_STATE = "controller_state.json"
_STEP_DIR = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")
_WEIGHTS_DIR = re.compile(rf"^{WEIGHTS_PREFIX}(\d+)$")


def checkpoint_folder_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def checkpoint_folders(folder: Path, complete_only: bool = True) -> list[tuple[int, Path]]:
    """(step, path) of each checkpoint folder in `folder` (a run's `checkpoints/`, a checkpoint mirror), oldest
    first; incomplete ones (no controller state: a save or a copy cut short) are skipped unless asked for."""
    found: list[tuple[int, Path]] = []
    if not folder.is_dir():
        return found
    for entry in folder.iterdir():
        match = _STEP_DIR.match(entry.name)
        if not match or not entry.is_dir():
            continue
        if complete_only and not (entry / CONTROLLER_STATE).is_file():
            continue
        found.append((int(match.group(1)), entry))
    return sorted(found)


class CorruptRunStateError(RuntimeError):
    """A file of the run directory that a resume needs is damaged and nothing earlier can stand in for it;
    the message names the file and what to do."""


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory (nothing is created until `create()`)."""

    root: Path

    @classmethod
    def at(cls, path: str | os.PathLike[str]) -> RunDir:
        return cls(Path(path).expanduser().resolve())

    # ---- files ----------------------------------------------------------------------------------------
    @property
    def config_yaml(self) -> Path:
        return self.root / "config.yaml"

    @property
    def plan_json(self) -> Path:
        return self.root / "plan.json"

    @property
    def desired_state_json(self) -> Path:
        return self.root / "desired_state.json"

    @property
    def status_json(self) -> Path:
        return self.root / "status.json"

    @property
    def metrics_jsonl(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def events_jsonl(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def learning_curve_png(self) -> Path:
        return self.root / "learning_curve.png"

    @property
    def controller_log(self) -> Path:
        return self.root / "controller.log"

    # ---- folders --------------------------------------------------------------------------------------
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def traces(self) -> Path:
        return self.root / "traces"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def rollout(self) -> Path:
        return self.root / "rollout"

    @property
    def training(self) -> Path:
        return self.root / "training"

    def create(self) -> RunDir:
        for folder in (self.root, self.checkpoints, self.traces, self.weights, self.rollout, self.training):
            folder.mkdir(parents=True, exist_ok=True)
        return self

    def is_existing_run(self) -> bool:
        """True when a run already wrote its configuration here (a launch on it resumes)."""
        return self.config_yaml.is_file()

    # ---- checkpoints ----------------------------------------------------------------------------------
    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / checkpoint_folder_name(step)

    def checkpoints_by_step(self, complete_only: bool = True) -> list[tuple[int, Path]]:
        """(step, path) of each checkpoint, oldest first; incomplete ones are skipped unless asked for."""
        return checkpoint_folders(self.checkpoints, complete_only)

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        found = self.checkpoints_by_step()
        return found[-1] if found else None

    # ---- published weights ----------------------------------------------------------------------------
    def weights_dir(self, version: int) -> Path:
        return self.weights / f"{WEIGHTS_PREFIX}{version:06d}"

    def weight_versions(self) -> list[tuple[int, Path]]:
        if not self.weights.is_dir():
            return []
        found = [
            (int(m.group(1)), e) for e in self.weights.iterdir() if (m := _WEIGHTS_DIR.match(e.name)) and e.is_dir()
        ]
        return sorted(found)

    def prune_weights(self, keep: set[int]) -> None:
        """Delete published weight folders except the versions in `keep`."""
        for version, path in self.weight_versions():
            if version not in keep:
                shutil.rmtree(path, ignore_errors=True)

    # ---- readers (for `libra status` and resume) ------------------------------------------------------
    def read_status(self) -> dict[str, Any] | None:
        return read_json(self.status_json)

    def read_metrics(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.metrics_jsonl))

    def tail_events(self, count: int) -> list[dict[str, Any]]:
        events = list(read_jsonl(self.events_jsonl))
        return events[-count:] if count > 0 else events


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so that a reader (or a crash) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True, default=str)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Objects of a JSON-lines file; a cut-off or malformed line (a crash mid-write) is skipped."""
    try:
        fh = open(path, encoding="utf-8")
    except FileNotFoundError:
        return
    with fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                yield obj


def append_jsonl(path: Path, obj: dict[str, Any]) -> None:
    """Append one object as one line (O_APPEND, a whole line per write). A write the disk cut short is taken
    back, so that the next line, once there is room, does not run into half a line."""
    data = (json.dumps(obj, sort_keys=True, default=str) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, f"only part of a line could be written to {path}")
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def truncate_jsonl_after_step(path: Path, step: int) -> int:
    """Drop rows whose `step` is greater than `step` (a resumed run repeats them); returns rows dropped."""
    rows = list(read_jsonl(path))
    kept = [r for r in rows if not isinstance(r.get("step"), int) or r["step"] <= step]
    if len(kept) == len(rows):
        return 0
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        for row in kept:
            fh.write(json.dumps(row, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
    return len(rows) - len(kept)


def process_alive_here(pid: object, host: object) -> bool | None:
    """Whether process `pid` (as a run directory records it, with the `host` it ran on) still runs; None when
    it ran on another host or no pid is recorded (only a connection can tell then)."""
    if not isinstance(pid, int) or host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
