"""Job checkpoints: the training pool's checkpoint plus the controller's own state (step, policy version,
position in the prompt stream, running totals), with retention.

`checkpoints/step_NNNNNN/train/` is written by the training pool; `controller_state.json` is written
last and atomically, so a checkpoint without it (a crash mid-save) is ignored on resume.

A checkpoint write that fails because the run directory's file system is full (`disk_full_error`) becomes a
`DiskFullError` naming the folder, the checkpoint a new launch resumes from and what to do; the half-written
folder is removed so that it gives its space back. The same goes for the export of a step's weights for the
rollout servers (`weights_disk_full_error`), which writes into the run directory too.

A resume (`restore_newest`) takes the newest checkpoint that loads: one whose controller state is unreadable
or whose training checkpoint the pool refuses (a truncated shard, a damaged `latest` marker) is restored from
the checkpoint mirror when the job keeps one (`checkpoint_mirror.py`), else skipped with a warning naming the
file, and the one before it is tried. A run whose every checkpoint is damaged stops with
`CorruptRunStateError` rather than silently starting again from step 0.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libra.controller.checkpoint_mirror import CheckpointMirror
from libra.error_chain import causes
from libra.run_dir import CHECKPOINT_PREFIX, CONTROLLER_STATE, CorruptRunStateError, RunDir, write_json_atomic

TRAIN_SUBDIR = "train"
# what a full disk says once it crossed a process boundary (a Ray worker, dist_checkpointing's writer)
_DISK_FULL_TEXT = ("No space left on device", "[Errno 28]", "Disk quota exceeded", "[Errno 122]")
_NEARLY_FULL_BYTES = 64 << 20
DETAIL_CHARS = 1000  # of an error's text quoted in a DiskFullError (a run directory's path is often 100 or more)


class DiskFullError(RuntimeError):
    """A checkpoint or a weight export could not be written because the run directory's file system is full;
    the message names the folder, the checkpoint a new launch resumes from, and what to do."""


@dataclass
class ControllerState:
    """What the controller needs, besides the model, to continue a run exactly where it stopped."""

    step: int = 0  # completed training steps (= policy version of the trainer)
    prompts_drawn: int = 0  # every prompt of the stream before this index is done (`PromptLedger.position`)
    prompts_done_ahead: list[int] = field(default_factory=list)  # the prompts done past it
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


def read_controller_state(path: Path, step: int) -> ControllerState:
    """The controller state of the checkpoint of `step`; CorruptRunStateError naming the file when it is
    unreadable, not a state, or of another step."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptRunStateError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from exc
    if not isinstance(data, dict):
        raise CorruptRunStateError(f"{path} holds {type(data).__name__}, not a controller state")
    try:
        state = ControllerState.from_dict(data)
    except TypeError as exc:
        raise CorruptRunStateError(f"{path} is not a controller state ({exc})") from exc
    numbers = {"step": state.step, "prompts_drawn": state.prompts_drawn, "sessions": state.sessions}
    bad = {k: v for k, v in numbers.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0}
    if bad:
        raise CorruptRunStateError(f"{path} has invalid counters {bad} (each must be an integer >= 0)")
    ahead = state.prompts_done_ahead
    if not isinstance(ahead, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                              and i > state.prompts_drawn for i in ahead):
        raise CorruptRunStateError(f"{path} has invalid prompts_done_ahead {ahead!r} (a list of prompt indices, "
                                   f"each past prompts_drawn {state.prompts_drawn})")
    if state.step != step:
        raise CorruptRunStateError(f"{path} is of step {state.step}, but its folder is of step {step}")
    return state


def checkpoint_step(train_dir: str) -> int:
    """The step of a job checkpoint's training directory (`.../step_NNNNNN/train`); -1 when not one."""
    digits = Path(train_dir).parent.name.removeprefix(CHECKPOINT_PREFIX)
    return int(digits) if Path(train_dir).parent.name.startswith(CHECKPOINT_PREFIX) and digits.isdigit() else -1


def _last_line(exc: BaseException) -> str:
    """The gist of an error raised in a worker (its text ends with the worker's own error line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def restore_newest(
    store: CheckpointStore, load: Callable[[str], int], warn: Callable[[str], None],
    mirror: CheckpointMirror | None = None,
) -> tuple[ControllerState, Path, int] | None:
    """Load the newest checkpoint that loads: (controller state, training checkpoint dir, step the training
    pool reports). Each checkpoint skipped is reported through `warn`, naming its file and what is wrong.
    With a `mirror`, a step whose checkpoint is damaged or missing in the run directory is first restored from
    the mirror's copy (the damaged folder is kept beside it) and loaded again. None when the run has no
    complete checkpoint; CorruptRunStateError when it has some and none loads."""
    problems: list[str] = []
    here = dict(store.run.checkpoints_by_step())
    mirrored = set(mirror.steps()) if mirror is not None else set()

    def attempt(step: int, folder: Path) -> tuple[ControllerState, Path, int] | str:
        train_dir = folder / TRAIN_SUBDIR
        try:
            state = read_controller_state(folder / CONTROLLER_STATE, step)
            return state, train_dir, load(str(train_dir))
        except Exception as exc:
            return str(exc) if isinstance(exc, CorruptRunStateError) else f"{train_dir}: {_last_line(exc)}"

    for step in sorted(set(here) | mirrored, reverse=True):
        folder = store.run.checkpoint_dir(step)
        found = attempt(step, folder) if step in here else f"{folder} is missing from the run directory"
        if not isinstance(found, str):
            return found
        if mirror is not None and step in mirrored:
            damaged = found
            try:
                aside = mirror.restore(step, folder)
            except OSError as exc:
                found = f"{damaged}; its mirror copy {mirror.folder(step)} could not be copied back ({exc})"
            else:
                again = attempt(step, folder)
                if not isinstance(again, str):
                    kept = f"; the damaged folder is kept at {aside}" if aside is not None else ""
                    warn(f"checkpoint of step {step} restored from the mirror {mirror.folder(step)} ({damaged}){kept}")
                    return again
                mirror.put_back(folder, aside)  # the run directory as it was: one damaged copy, not two
                # the copy was loaded from the run directory: name the mirror's files, which hold the damage
                found = f"{damaged}; its mirror copy is damaged too: {again.replace(str(folder), str(mirror.folder(step)))}"
        problems.append(found)
        warn(f"checkpoint of step {step} skipped: {found}; trying the one before it")
    if problems:
        raise CorruptRunStateError(
            f"no checkpoint under {store.run.checkpoints} can be loaded: " + " | ".join(problems)
            + ". Restore the damaged files, or move the run directory aside to start the run again from step 0")
    return None


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def says_disk_full(exc: BaseException) -> bool:
    """`exc`, or an error in its chain of causes, is ENOSPC / EDQUOT or says so in its text (as an error
    raised in another process does)."""
    return any(getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
               or any(text in str(cause) for text in _DISK_FULL_TEXT) for cause in causes(exc))


def _free_and_needed(root: Path, previous: Path | None) -> tuple[int, int]:
    """Free bytes on the file system of `root`, and the room a write like `previous` (the last one of its
    kind) needs (at least `_NEARLY_FULL_BYTES`); (0, 0) when the file system cannot be read."""
    try:
        return shutil.disk_usage(root).free, max(_NEARLY_FULL_BYTES, _folder_bytes(previous) if previous else 0)
    except OSError:
        return 0, 0


def _detail(exc: BaseException, limit: int = DETAIL_CHARS) -> str:
    """The last line of `exc`'s text (a traceback from another process ends with the error), whole unless it
    is longer than `limit`: then cut at the last space before it, so a path in it is never cut in two."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    line = text.splitlines()[-1]
    if len(line) <= limit:
        return line
    cut = line.rfind(" ", 0, limit)
    return (line[:cut] if cut > 0 else line[:limit]) + " ..."


def _resume_from(store: CheckpointStore, but: int | None = None) -> str:
    """What a new launch resumes from: the newest complete checkpoint (other than step `but`)."""
    complete = [s for s, _ in store.run.checkpoints_by_step() if s != but]
    return (f"the checkpoint of step {complete[-1]} is whole and a new launch resumes from it" if complete
            else "no earlier checkpoint exists, so a new launch starts from step 0")


def _free_space_hint(store: CheckpointStore) -> str:
    return (f"Free space on the file system of {store.run.root} (df -h {store.run.root}; keep_last in the "
            "checkpoint section limits how many checkpoints stay), then launch again")


def disk_full_error(store: CheckpointStore, step: int, exc: BaseException) -> DiskFullError | None:
    """The error to stop with when writing the checkpoint of `step` failed with `exc` on a full disk: an
    ENOSPC / EDQUOT error, one whose text says so (raised in another process), or any write error while the
    file system has less room left than the previous checkpoint took (torch reports only "file write
    failed"). None for any other failure. The half-written folder of `step` is removed."""
    folder = store.run.checkpoint_dir(step)
    previous = [(s, f) for s, f in store.run.checkpoints_by_step() if s != step]
    free, needed = _free_and_needed(store.run.root, previous[-1][1] if previous else None)
    if not says_disk_full(exc) and free >= needed:
        return None
    if not (folder / CONTROLLER_STATE).is_file():
        shutil.rmtree(folder, ignore_errors=True)
    return DiskFullError(
        f"the disk is full: the checkpoint of step {step} could not be written to {folder} ({_detail(exc)}; "
        f"{free} bytes free); {_resume_from(store, but=step)}. {_free_space_hint(store)}")


def weights_disk_full_error(store: CheckpointStore, version: int, exc: BaseException) -> DiskFullError | None:
    """The error to stop with when exporting the weights of step `version` for the rollout servers failed with
    `exc` on a full disk (as `disk_full_error` tells it, the room needed being the last export's size); None
    for any other failure. The half-written folder is removed; the newest complete checkpoint is the one a new
    launch resumes from (the steps after it are trained again, each counted once)."""
    run = store.run
    folder = run.weights_dir(version)
    previous = [f for v, f in run.weight_versions() if v != version]
    free, needed = _free_and_needed(run.root, previous[-1] if previous else None)
    if not says_disk_full(exc) and free >= needed:
        return None
    shutil.rmtree(folder, ignore_errors=True)
    return DiskFullError(
        f"the disk is full: the weights of step {version} could not be exported to {folder} for the rollout "
        f"servers ({_detail(exc)}; {free} bytes free); {_resume_from(store)}. {_free_space_hint(store)}")


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
        """The newest complete checkpoint, unloaded (CorruptRunStateError when its state is unreadable)."""
        found = self.run.latest_checkpoint()
        if found is None:
            return None
        step, folder = found
        return read_controller_state(folder / CONTROLLER_STATE, step), folder / TRAIN_SUBDIR


__all__ = ["CheckpointStore", "ControllerState", "CorruptRunStateError", "DiskFullError", "checkpoint_step",
           "disk_full_error", "read_controller_state", "restore_newest", "retained_steps"]
