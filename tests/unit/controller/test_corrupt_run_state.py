"""Damaged run-directory state at start: a job checkpoint's controller state, a training checkpoint the pool
refuses, `desired_state.json`, the rollout registry. Each gives a clear error naming the file (and what to
do) or falls back to the previous good checkpoint with a warning; never a silent restart from step 0 or a
resume from wrong state."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from libra.controller.checkpoints import (
    CheckpointStore,
    ControllerState,
    CorruptRunStateError,
    checkpoint_step,
    restore_newest,
)
from libra.controller.state import DesiredState
from libra.rollout.registry import InstanceRegistry, RegistryError
from libra.run_dir import RunDir
from planner.layout import TrainLayout

DAMAGED = "damaged"  # a training checkpoint holding this file is refused by the fake pool below


def corrupt(path: Path, kind: str, wrong_shape: str) -> None:
    data = path.read_bytes()
    damage: dict[str, Callable[[], bytes]] = {
        "truncated": lambda: data[: len(data) // 2],
        "empty": lambda: b"",
        "garbage": lambda: bytes(range(256)) * 4,
        "wrong-shape": lambda: wrong_shape.encode(),
    }
    path.write_bytes(damage[kind]())


KINDS = ["truncated", "empty", "garbage", "wrong-shape"]


def run_with_checkpoints(tmp_path: Path, steps: tuple[int, ...] = (2, 4)) -> tuple[RunDir, CheckpointStore]:
    run = RunDir.at(tmp_path / "run").create()
    store = CheckpointStore(run, keep_last=0, keep_every=0)
    for step in steps:
        (store.begin(step) / "model.bin").write_bytes(b"w")
        store.commit(ControllerState(step=step, prompts_drawn=step * 4))
    return run, store


def fake_pool_load(train_dir: str) -> int:
    if (Path(train_dir) / DAMAGED).exists():
        raise RuntimeError(f"train.load_checkpoint failed on rank 0: ray::TrainingWorker.load_checkpoint()\n"
                           f"  File \"worker.py\", line 1\nCorruptCheckpointError: {train_dir}/x.distcp is truncated")
    return checkpoint_step(train_dir)


def test_newest_good_checkpoint_is_loaded_without_warnings(tmp_path: Path) -> None:
    _, store = run_with_checkpoints(tmp_path)
    warnings: list[str] = []
    state, train_dir, loaded = restore_newest(store, fake_pool_load, warnings.append)  # type: ignore[misc]
    assert (state.step, state.prompts_drawn, loaded, warnings) == (4, 16, 4, [])


@pytest.mark.parametrize("kind", KINDS, ids=KINDS)
def test_damaged_controller_state_falls_back_to_the_previous_checkpoint(tmp_path: Path, kind: str) -> None:
    run, store = run_with_checkpoints(tmp_path)
    state_file = run.checkpoint_dir(4) / "controller_state.json"
    corrupt(state_file, kind, wrong_shape='{"step": 3, "prompts_drawn": -1}')
    warnings: list[str] = []
    state, train_dir, loaded = restore_newest(store, fake_pool_load, warnings.append)  # type: ignore[misc]
    assert (state.step, loaded, train_dir) == (2, 2, run.checkpoint_dir(2) / "train")
    assert len(warnings) == 1 and str(state_file) in warnings[0] and "step 4 skipped" in warnings[0]


def test_training_checkpoint_refused_by_the_pool_falls_back_with_the_workers_reason(tmp_path: Path) -> None:
    run, store = run_with_checkpoints(tmp_path)
    (run.checkpoint_dir(4) / "train" / DAMAGED).touch()
    warnings: list[str] = []
    state, _, _ = restore_newest(store, fake_pool_load, warnings.append)  # type: ignore[misc]
    assert state.step == 2
    assert len(warnings) == 1 and "x.distcp is truncated" in warnings[0] and "File " not in warnings[0]


@pytest.mark.parametrize("kind", KINDS, ids=KINDS)
def test_every_checkpoint_damaged_is_an_error_naming_each_file(tmp_path: Path, kind: str) -> None:
    run, store = run_with_checkpoints(tmp_path)
    corrupt(run.checkpoint_dir(4) / "controller_state.json", kind, wrong_shape="[4]")
    (run.checkpoint_dir(2) / "train" / DAMAGED).touch()
    with pytest.raises(CorruptRunStateError) as err:
        restore_newest(store, fake_pool_load, lambda message: None)
    message = str(err.value)
    assert str(run.checkpoint_dir(4) / "controller_state.json") in message
    assert str(run.checkpoint_dir(2) / "train") in message and "move the run directory aside" in message


def test_a_run_without_checkpoints_starts_fresh(tmp_path: Path) -> None:
    _, store = run_with_checkpoints(tmp_path, steps=())
    assert restore_newest(store, fake_pool_load, lambda message: None) is None


def test_latest_reports_a_damaged_state_instead_of_starting_over(tmp_path: Path) -> None:
    run, store = run_with_checkpoints(tmp_path)
    corrupt(run.checkpoint_dir(4) / "controller_state.json", "truncated", "")
    with pytest.raises(CorruptRunStateError, match="controller_state.json is unreadable"):
        store.latest()


def desired_file(tmp_path: Path) -> Path:
    path = tmp_path / "desired_state.json"
    DesiredState(rollout_instances=2, rollout_tp=1, train_gpus=2, train_layout=TrainLayout()).save(path)
    return path


@pytest.mark.parametrize(
    ("kind", "wrong_shape"),
    [("truncated", ""), ("empty", ""), ("garbage", ""), ("wrong-shape", "[1, 2]"),
     ("wrong-shape", '{"rollout_instances": 2, "rollout_tp": 1}'),
     ("wrong-shape", '{"rollout_instances": -1, "rollout_tp": 0, "train_gpus": 1, "train_layout": {}}'),
     ("wrong-shape", '{"rollout_instances": 1, "rollout_tp": 1, "train_gpus": 1, "train_layout": {"tq": 2}}')],
    ids=["truncated", "empty", "garbage", "a-list", "missing-fields", "negative-counts", "unknown-layout-field"],
)
def test_damaged_desired_state_is_an_error_naming_the_file(tmp_path: Path, kind: str, wrong_shape: str) -> None:
    path = desired_file(tmp_path)
    corrupt(path, kind, wrong_shape)
    with pytest.raises(CorruptRunStateError) as err:
        DesiredState.load(path)
    assert str(path) in str(err.value) and "delete it" in str(err.value)


def test_intact_desired_state_round_trips(tmp_path: Path) -> None:
    loaded = DesiredState.load(desired_file(tmp_path))
    assert loaded is not None and (loaded.rollout_instances, loaded.train_gpus) == (2, 2)


def registry_file(tmp_path: Path) -> Path:
    path = tmp_path / "rollout" / "registry.json"
    path.parent.mkdir(parents=True)
    entry = {"instance_id": "rollout-0", "host": "127.0.0.1", "hostname": "h", "port": 8100, "pid": 123,
             "start_ticks": 5, "gpu_ids": ["0"], "weight_version": 3, "checksum": "c", "model_path": "/m",
             "actor_name": "a", "fingerprint": {}, "log_path": "/l", "started_at": 1.0}
    path.write_text(json.dumps({"schema": 1, "pool": {"weight_version": 3}, "instances": {"rollout-0": entry}}))
    return path


@pytest.mark.parametrize(
    ("kind", "wrong_shape"),
    [("truncated", ""), ("empty", ""), ("garbage", ""), ("wrong-shape", "[]"),
     ("wrong-shape", '{"schema": 1, "instances": {"rollout-0": [1]}}'),
     ("wrong-shape", '{"schema": 1, "pool": {"weight_version": "x"}}'),
     ("wrong-shape", '{"schema": 1, "instances": "rollout-0"}')],
    ids=["truncated", "empty", "garbage", "a-list", "entry-not-an-object", "version-not-a-number",
         "instances-not-a-map"],
)
def test_damaged_registry_is_an_error_naming_the_file(tmp_path: Path, kind: str, wrong_shape: str) -> None:
    path = registry_file(tmp_path)
    corrupt(path, kind, wrong_shape)
    with pytest.raises(RegistryError) as err:
        InstanceRegistry(str(tmp_path)).load()
    assert str(path) in str(err.value) and "remove the file" in str(err.value)


@pytest.mark.parametrize(("field", "value"), [("pid", "123"), ("pid", -4), ("port", None), ("start_ticks", True)],
                         ids=["pid-string", "pid-negative", "port-null", "ticks-bool"])
def test_registry_entry_with_a_wrong_number_is_refused(tmp_path: Path, field: str, value: object) -> None:
    path = registry_file(tmp_path)
    data = json.loads(path.read_text())
    data["instances"]["rollout-0"][field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(RegistryError, match=f"invalid .*'{field}'"):
        InstanceRegistry(str(tmp_path)).load()
    assert InstanceRegistry(str(tmp_path / "none")).load().entries == {}


@pytest.mark.parametrize("ahead", [
    pytest.param("[5, 6]", id="not-a-list"),
    pytest.param([8, 3], id="an-index-before-the-position"),
    pytest.param([8], id="the-position-itself"),
    pytest.param([9, True], id="not-an-index"),
])
def test_prompts_done_ahead_that_cannot_be_falls_back_to_the_previous_checkpoint(tmp_path: Path, ahead: object) -> None:
    run, store = run_with_checkpoints(tmp_path)
    state_file = run.checkpoint_dir(4) / "controller_state.json"
    data = json.loads(state_file.read_text())
    data["prompts_done_ahead"] = ahead
    data["prompts_drawn"] = 8
    state_file.write_text(json.dumps(data))
    warnings: list[str] = []
    state, _, loaded = restore_newest(store, fake_pool_load, warnings.append)  # type: ignore[misc]
    assert (state.step, loaded) == (2, 2)
    assert len(warnings) == 1 and "prompts_done_ahead" in warnings[0], warnings
