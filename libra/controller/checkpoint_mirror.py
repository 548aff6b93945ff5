"""The second copy of a job's checkpoints (`checkpoint.mirror_dir`): every complete checkpoint is copied there
in the background, with the run directory's retention, and a resume whose checkpoint of a step is damaged or
missing in the run directory takes the mirror's copy of that step before an older checkpoint.

A copy is written to a hidden `.partial-step_NNNNNN` folder and renamed into place once whole (files flushed to
disk first), so a mirror folder named `step_NNNNNN` is always a whole copy; a copy that fails (a full disk, a
mirror that went away) removes its partial folder and is reported through `warn`, and the job goes on: its run
directory still holds the checkpoint. One copy runs at a time, in the order the checkpoints were committed; the
job's shutdown waits for the copies in flight (`close`).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from libra.run_dir import checkpoint_folder_name, checkpoint_folders

_PARTIAL = ".partial-"


def copy_whole(source: Path, target: Path) -> None:
    """Copy the folder `source` to `target` (which must not exist) through a partial folder beside it, each
    file flushed to disk before the rename that makes the copy visible."""
    partial = target.with_name(_PARTIAL + target.name)
    shutil.rmtree(partial, ignore_errors=True)
    try:
        shutil.copytree(source, partial)
        for path in sorted(partial.rglob("*")):
            if path.is_file():
                with open(path, "rb") as fh:
                    os.fsync(fh.fileno())
        os.replace(partial, target)
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


class CheckpointMirror:
    """Copies committed checkpoints to `root` and finds them there again."""

    def __init__(self, root: Path, keep: Callable[[list[int]], set[int]], warn: Callable[[str], object],
                 done: Callable[[int, Path, float], None] | None = None) -> None:
        self.root = root
        self.keep = keep  # steps -> the steps retention keeps (the run directory's rule)
        self.warn = warn
        self.done = done
        self._copier = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-mirror")

    def folder(self, step: int) -> Path:
        return self.root / checkpoint_folder_name(step)

    def steps(self) -> list[int]:
        """Steps whose whole copy the mirror holds (its controller state present), oldest first."""
        return [step for step, _ in checkpoint_folders(self.root)]

    def submit(self, step: int, source: Path) -> concurrent.futures.Future[None]:
        """Copy the committed checkpoint folder `source` of `step` in the background (a failure is warned about
        there, never raised); the copy's future (the job does not wait for it)."""
        return self._copier.submit(self._copy, step, source)

    def _copy(self, step: int, source: Path) -> None:
        began = time.monotonic()
        target = self.folder(step)
        if not source.is_dir():
            return  # retention removed it before its turn came (copies slower than checkpoints): nothing to keep
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(target, ignore_errors=True)  # an older copy of the same step (a step trained again)
            copy_whole(source, target)
        except Exception as exc:
            self.warn(f"the checkpoint of step {step} was not copied to the mirror {self.root} ({type(exc).__name__}: "
                      f"{exc}); it stays in {source}. Check the mirror's file system (free space, mount)")
            return
        self.prune()
        if self.done is not None:
            self.done(step, target, time.monotonic() - began)

    def prune(self) -> list[int]:
        """Remove the copies retention no longer keeps, and partial copies a stopped job left (one copy runs at a
        time, so none is in flight while this runs on the copier)."""
        for entry in self.root.glob(_PARTIAL + "*"):
            shutil.rmtree(entry, ignore_errors=True)
        steps = self.steps()
        keep = self.keep(steps)
        removed = [s for s in steps if s not in keep]
        for step in removed:
            shutil.rmtree(self.folder(step), ignore_errors=True)
        return removed

    def restore(self, step: int, target: Path) -> Path | None:
        """Put the mirror's copy of `step` at `target` (the run directory's checkpoint folder of that step); a
        folder already there (a damaged copy) is moved aside first and kept. Returns where it was moved (None
        when nothing was there); a copy that fails puts the run directory back as it was."""
        aside = None
        if target.exists():
            aside = target.with_name(f"{target.name}.damaged-{int(time.time())}")
            os.replace(target, aside)
        try:
            copy_whole(self.folder(step), target)
        except BaseException:
            self.put_back(target, aside)
            raise
        return aside

    def put_back(self, target: Path, aside: Path | None) -> None:
        """Undo `restore`: remove the copy at `target` and move the folder set aside back (if any)."""
        shutil.rmtree(target, ignore_errors=True)
        if aside is not None:
            os.replace(aside, target)

    def close(self) -> None:
        """Wait for the copies in flight, then stop the copier."""
        self._copier.shutdown(wait=True)
