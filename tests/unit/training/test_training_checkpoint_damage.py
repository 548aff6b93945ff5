"""A damaged training checkpoint is refused before the collective load, by an error naming the file: the
`latest` marker, the sharded index, a tensor shard, the metadata, the common and RNG state."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from libra.training.checkpoint import LATEST, META, CorruptCheckpointError, step_dir_name, verify


def make_checkpoint(root: Path, step: int = 6) -> Path:
    """A checkpoint in the layout `checkpoint.save` writes (torch_dist shards, metadata, common, RNG)."""
    import torch.distributed.checkpoint as dcp

    ckpt = root / step_dir_name(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"w": torch.arange(64.0), "b": torch.ones(8, 8)}}, checkpoint_id=str(ckpt))
    (ckpt / META).write_text(json.dumps({"step": step, "layout": {"tp": 1}, "scheduler": {"num_steps": step}}))
    torch.save({"iteration": step}, ckpt / "common.pt")
    (ckpt / "rng").mkdir()
    torch.save({"cpu": torch.get_rng_state()}, ckpt / "rng" / "rank_00000.pt")
    (root / LATEST).write_text(step_dir_name(step))
    return ckpt


def shard(ckpt: Path) -> Path:
    return next(ckpt.glob("*.distcp"))


def cut(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


# (what is damaged, how, the error type, the file the message must name)
CASES = {
    "latest-truncated": (lambda c: (c.parent / LATEST).write_text("step_000"), FileNotFoundError, LATEST),
    "latest-empty": (lambda c: (c.parent / LATEST).write_text(""), FileNotFoundError, LATEST),
    "latest-garbage": (lambda c: (c.parent / LATEST).write_bytes(bytes(range(256))), FileNotFoundError, LATEST),
    "latest-points-outside": (lambda c: (c.parent / LATEST).write_text("../../etc"), FileNotFoundError, LATEST),
    "shard-truncated": (lambda c: cut(shard(c), 0.5), CorruptCheckpointError, ".distcp is truncated"),
    "shard-empty": (lambda c: cut(shard(c), 0.0), CorruptCheckpointError, ".distcp is truncated"),
    "shard-missing": (lambda c: shard(c).unlink(), CorruptCheckpointError, ".distcp is missing"),
    "index-truncated": (lambda c: cut(c / ".metadata", 0.3), CorruptCheckpointError, ".metadata is unreadable"),
    "meta-garbage": (lambda c: (c / META).write_text("{step: "), CorruptCheckpointError, META),
    "meta-wrong-shape": (lambda c: (c / META).write_text('{"step": "6"}'), CorruptCheckpointError, META),
    "common-truncated": (lambda c: cut(c / "common.pt", 0.5), CorruptCheckpointError, "common.pt is unreadable"),
    "rng-truncated": (lambda c: cut(c / "rng" / "rank_00000.pt", 0.5), CorruptCheckpointError, "rank_00000.pt"),
}


def test_intact_checkpoint_verifies(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path)
    assert verify(str(tmp_path)) == str(ckpt)
    assert verify(str(ckpt)) == str(ckpt)


@pytest.mark.parametrize(("damage", "error", "named"), CASES.values(), ids=CASES.keys())
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path: Path, damage, error, named) -> None:  # type: ignore[no-untyped-def]
    ckpt = make_checkpoint(tmp_path)
    damage(ckpt)
    with pytest.raises(error) as err:
        verify(str(tmp_path))
    message = str(err.value)
    assert named in message and "earlier checkpoint" in message, message
    assert str(tmp_path) in message


def test_every_problem_is_listed_at_once(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path)
    cut(shard(ckpt), 0.5)
    cut(ckpt / "rng" / "rank_00000.pt", 0.5)
    with pytest.raises(CorruptCheckpointError) as err:
        verify(str(ckpt))
    assert "truncated" in str(err.value) and "rank_00000.pt" in str(err.value)
    assert os.path.isdir(ckpt), "verification never changes the checkpoint"
