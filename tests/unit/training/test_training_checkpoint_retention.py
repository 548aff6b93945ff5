"""Checkpoint retention (pure) and checkpoint directory resolution."""

from __future__ import annotations

import os

import pytest

from libra.training.checkpoint import LATEST, META, checkpoints_to_delete, list_steps, resolve, step_dir_name

CASES = {
    "keep-last-two": ([1, 2, 3, 4], 2, 0, None, [1, 2]),
    "keep-every-two": ([1, 2, 3, 4, 5], 1, 2, None, [1, 3]),
    "keep-every-and-last": ([10, 20, 30, 40, 50], 2, 20, None, [10, 30]),
    "protect-published": ([1, 2, 3], 1, 0, 1, [2]),
    "nothing-to-delete": ([7], 3, 0, None, []),
    "unsorted-with-duplicates": ([4, 1, 3, 1, 2], 2, 0, None, [1, 2]),
}


@pytest.mark.parametrize("steps,last,every,protect,expected", CASES.values(), ids=CASES.keys())
def test_checkpoints_to_delete(steps: list[int], last: int, every: int, protect: int | None, expected: list[int]) -> None:
    assert checkpoints_to_delete(steps, last, every, protect) == expected


def test_keep_last_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keep_last=0"):
        checkpoints_to_delete([1], 0, 0)


def test_resolve_and_list(tmp_path: os.PathLike) -> None:
    root = str(tmp_path)
    for step in (3, 12):
        os.makedirs(os.path.join(root, step_dir_name(step)))
        open(os.path.join(root, step_dir_name(step), META), "w").close()
    os.makedirs(os.path.join(root, ".tmp-" + step_dir_name(14)))  # in progress: not listed
    assert list_steps(root) == [3, 12]
    with pytest.raises(FileNotFoundError, match="neither a checkpoint root"):
        resolve(root)
    with open(os.path.join(root, LATEST), "w") as fh:
        fh.write(step_dir_name(12))
    assert resolve(root).endswith("step_00000012")
    assert resolve(os.path.join(root, step_dir_name(3))).endswith("step_00000003")
    with open(os.path.join(root, LATEST), "w") as fh:
        fh.write(step_dir_name(99))
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve(root)
