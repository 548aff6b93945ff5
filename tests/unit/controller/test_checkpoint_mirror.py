"""The checkpoint mirror (`checkpoint.mirror_dir`): committed checkpoints are copied whole, with the run
directory's retention; a copy that fails leaves nothing half-written and the job goes on; a resume whose
checkpoint is damaged or missing in the run directory takes the mirror's copy of that step (the damaged folder
kept beside it), and falls back to an older checkpoint only when the mirror's copy fails too."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from libra.controller.checkpoint_mirror import CheckpointMirror
from libra.controller.checkpoints import (
    CheckpointStore,
    ControllerState,
    CorruptRunStateError,
    checkpoint_step,
    restore_newest,
    retained_steps,
)
from libra.run_dir import RunDir

DAMAGED = "damaged"  # a training checkpoint holding this file is refused by the fake pool below


def fake_pool_load(train_dir: str) -> int:
    if (Path(train_dir) / DAMAGED).exists():
        raise RuntimeError(f"CorruptCheckpointError: {train_dir}/x.distcp is truncated")
    return checkpoint_step(train_dir)


class Job:
    """A run directory with a mirror beside it, each commit copied as the RL loop does."""

    def __init__(self, tmp_path: Path, keep_last: int = 0, mirror_root: Path | None = None) -> None:
        self.run = RunDir.at(tmp_path / "run").create()
        self.store = CheckpointStore(self.run, keep_last=keep_last, keep_every=0)
        self.warnings: list[str] = []
        self.copied: list[int] = []
        self.mirror = CheckpointMirror(mirror_root or tmp_path / "mirror",
                                       lambda steps: retained_steps(steps, keep_last, 0), self.warnings.append,
                                       lambda step, path, seconds: self.copied.append(step))

    def commit(self, *steps: int) -> None:
        for step in steps:
            train = self.store.begin(step)
            (train / "model.bin").write_bytes(b"w" * 64)
            (train / "nested").mkdir()
            (train / "nested" / "shard.distcp").write_bytes(b"s" * 128)
            folder = self.store.commit(ControllerState(step=step, prompts_drawn=step * 4))
            # each copy ends before the next commit, as in a job, where a step lies between two checkpoints: a
            # copy still queued when retention removes its step is skipped (a case of its own below)
            self.mirror.submit(step, folder).result(timeout=60)
        self.mirror.close()

    def restore(self) -> tuple[ControllerState, Path, int] | None:
        return restore_newest(self.store, fake_pool_load, self.warnings.append, self.mirror)


def test_committed_checkpoints_are_copied_whole_with_the_run_directorys_retention(tmp_path: Path) -> None:
    job = Job(tmp_path, keep_last=2)
    job.commit(2, 4, 6)
    assert job.copied == [2, 4, 6] and job.warnings == []
    assert job.mirror.steps() == [4, 6] == [s for s, _ in job.run.checkpoints_by_step()]
    copy = job.mirror.folder(6)
    assert (copy / "train" / "nested" / "shard.distcp").read_bytes() == b"s" * 128
    assert (copy / "controller_state.json").read_text() == (job.run.checkpoint_dir(6) / "controller_state.json").read_text()
    assert not [p for p in job.mirror.root.iterdir() if p.name.startswith(".partial-")]


def test_a_copy_that_fails_warns_leaves_nothing_half_written_and_the_job_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the mirror should be")
    job = Job(tmp_path, mirror_root=blocker / "mirror")
    job.commit(2)
    assert job.copied == [] and len(job.warnings) == 1
    assert job.warnings[0].startswith(f"the checkpoint of step 2 was not copied to the mirror {blocker / 'mirror'}")
    assert "it stays in" in job.warnings[0] and [s for s, _ in job.run.checkpoints_by_step()] == [2]
    assert job.mirror.steps() == []


def damage(job: Job, step: int, where: str) -> None:
    folder = job.run.checkpoint_dir(step) if where == "run" else job.mirror.folder(step)
    (folder / "train" / DAMAGED).touch()


@pytest.mark.parametrize(("run_damage", "mirror_damage", "missing", "resumed", "restored"), [
    pytest.param(4, None, None, 4, True, id="damaged-newest-restored-from-the-mirror"),
    pytest.param(None, None, 4, 4, True, id="missing-newest-restored-from-the-mirror"),
    pytest.param(4, 4, None, 2, False, id="mirror-copy-damaged-too-falls-back"),
    pytest.param(None, 4, None, 4, False, id="a-damaged-mirror-copy-is-not-used"),
    pytest.param(None, None, None, 4, False, id="nothing-damaged"),
])
def test_a_resume_takes_the_mirrors_copy_of_a_damaged_or_missing_step(
        tmp_path: Path, run_damage: int | None, mirror_damage: int | None, missing: int | None, resumed: int,
        restored: bool) -> None:
    job = Job(tmp_path)
    job.commit(2, 4)
    if run_damage:
        damage(job, run_damage, "run")
    if mirror_damage:
        damage(job, mirror_damage, "mirror")
    if missing:
        shutil.rmtree(job.run.checkpoint_dir(missing))
    found = job.restore()
    assert found is not None
    state, train_dir, loaded = found
    assert (state.step, loaded, train_dir) == (resumed, resumed, job.run.checkpoint_dir(resumed) / "train")
    kept = [p.name.split(".damaged-")[0] for p in job.run.checkpoints.iterdir() if ".damaged-" in p.name]
    if restored:
        assert len(job.warnings) == 1 and "restored from the mirror" in job.warnings[0], job.warnings
        assert not (job.run.checkpoint_dir(4) / "train" / DAMAGED).exists()
        assert kept == (["step_000004"] if run_damage else []), kept  # the damaged folder is kept, not removed
        if run_damage:
            assert "x.distcp is truncated" in job.warnings[0] and "damaged folder is kept at" in job.warnings[0]
        else:
            assert "missing from the run directory" in job.warnings[0]
    elif run_damage:
        assert len(job.warnings) == 1 and "step 4 skipped" in job.warnings[0]
        assert f"its mirror copy is damaged too: {job.mirror.folder(4)}/train" in job.warnings[0], job.warnings
        assert kept == [] and (job.run.checkpoint_dir(4) / "train" / DAMAGED).exists()  # put back as it was
    else:
        assert job.warnings == [] and kept == []


def test_every_copy_damaged_is_still_an_error_naming_each_file(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.commit(2)
    damage(job, 2, "run")
    damage(job, 2, "mirror")
    with pytest.raises(CorruptRunStateError, match="its mirror copy is damaged too"):
        job.restore()


def test_a_run_directory_lost_whole_resumes_from_the_mirror(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.commit(2, 4)
    shutil.rmtree(job.run.checkpoints)
    job.run.checkpoints.mkdir()
    found = job.restore()
    assert found is not None and found[0].step == 4
    assert [s for s, _ in job.run.checkpoints_by_step()] == [4]


def test_a_restore_whose_copy_fails_puts_the_run_directory_back(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import libra.controller.checkpoint_mirror as mirror_module

    job = Job(tmp_path)
    job.commit(2, 4)
    damage(job, 4, "run")

    def no_room(source: Path, target: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mirror_module, "copy_whole", no_room)
    found = job.restore()
    assert found is not None and found[0].step == 2
    assert "its mirror copy" in job.warnings[0] and "could not be copied back" in job.warnings[0], job.warnings
    assert (job.run.checkpoint_dir(4) / "train" / DAMAGED).exists()  # the run directory's folder, as it was
    assert not [p for p in job.run.checkpoints.iterdir() if ".damaged-" in p.name]


def test_a_checkpoint_removed_before_its_copy_is_not_copied_nor_warned_about(tmp_path: Path) -> None:
    job = Job(tmp_path)
    gone = tmp_path / "run" / "checkpoints" / "step_000009"
    job.mirror.submit(9, gone)
    job.mirror.close()
    assert job.copied == [] and job.warnings == [] and job.mirror.steps() == []


def test_a_partial_copy_left_by_a_stopped_job_is_removed_at_the_next_copy(tmp_path: Path) -> None:
    job = Job(tmp_path)
    left = job.mirror.root / ".partial-step_000001"
    (left / "train").mkdir(parents=True)
    job.commit(2)
    assert sorted(p.name for p in job.mirror.root.iterdir()) == ["step_000002"]
