"""A starting instance loads a private copy of the weights current at its start: the RL loop goes on
publishing (and pruning older weight folders) during the tens of seconds a server takes to start."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from libra.config.mapping import config_with, rollout_pool_spec
from libra.rollout.lifecycle import InstanceManager
from libra.rollout.registry import PoolRecord
from libra.rollout.spec import ServerStartError


def manager(tmp_path: Path, model_path: str) -> InstanceManager:
    spec = rollout_pool_spec(config_with(str(tmp_path / "base")), num_instances=1, kv_cache_bytes=64 * 2**20)
    m = InstanceManager(spec, SimpleNamespace(namespace="ns"), str(tmp_path / "run"), session=None)  # type: ignore[arg-type]
    m.record = PoolRecord(model_path=model_path, weight_version=3, checksum="c3")
    return m


def published(tmp_path: Path, version: int) -> Path:
    folder = tmp_path / "run" / "weights" / f"v{version:06d}"
    (folder / "sub").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * 64)
    (folder / "sub" / "tokenizer.json").write_text("{}")
    return folder


def test_published_weights_are_pinned_and_survive_a_prune(tmp_path: Path) -> None:
    source = published(tmp_path, 3)
    m = manager(tmp_path, str(source))
    pinned = asyncio.run(m._pin_current_weights("rollout-1"))
    assert (pinned.source, pinned.version, pinned.checksum, pinned.pinned) == (str(source), 3, "c3", True)
    m.record = PoolRecord(model_path="elsewhere", weight_version=4, checksum="c4")  # a publish meanwhile
    for path in sorted(source.rglob("*"), reverse=True):  # and its prune of v3
        path.unlink() if path.is_file() else path.rmdir()
    copy = Path(pinned.model_path)
    assert (copy / "model.safetensors").read_bytes() == b"w" * 64 and (copy / "sub" / "tokenizer.json").exists()


def test_the_base_model_is_loaded_in_place(tmp_path: Path) -> None:
    m = manager(tmp_path, str(tmp_path / "base"))
    pinned = asyncio.run(m._pin_current_weights("rollout-1"))
    assert (pinned.model_path, pinned.pinned) == (str(tmp_path / "base"), False)


def test_weights_gone_before_they_are_pinned_is_a_clear_error(tmp_path: Path) -> None:
    m = manager(tmp_path, str(tmp_path / "run" / "weights" / "v000003"))  # already pruned
    with pytest.raises(ServerStartError, match="rollout-1: the current weights changed 5 times"):
        asyncio.run(m._pin_current_weights("rollout-1"))
