"""Run directory layout, checkpoints and their retention, JSONL helpers, the learning curve, and the
status command reading a run directory."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from libra.cli.main import main
from libra.controller import reporting
from libra.controller.checkpoints import CheckpointStore, ControllerState, retained_steps
from libra.controller.curve import moving_average, plot_learning_curve
from libra.controller.events import EventLog
from libra.controller.reporting import Reporter
from libra.controller.state import DesiredState, TrainLayout
from libra.observability.console import NullConsole
from libra.run_dir import RunDir, append_jsonl, read_jsonl, truncate_jsonl_after_step, write_json_atomic


@pytest.mark.parametrize(
    ("steps", "keep_last", "keep_every", "kept"),
    [
        pytest.param([5, 10, 15, 20], 2, 0, {15, 20}, id="last-two"),
        pytest.param([5, 10, 15, 20], 1, 10, {10, 20}, id="last-and-every-10"),
        pytest.param([5, 10, 15, 20], 0, 0, {5, 10, 15, 20}, id="keep-all"),
        pytest.param([], 2, 0, set(), id="none"),
    ],
)
def test_retention(steps: list[int], keep_last: int, keep_every: int, kept: set[int]) -> None:
    assert retained_steps(steps, keep_last, keep_every) == kept


def test_checkpoint_store_commit_prune_and_ignore_incomplete(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path / "run").create()
    store = CheckpointStore(run, keep_last=2, keep_every=0)
    for step in (1, 2, 3):
        train = store.begin(step)
        (train / "weights.bin").write_bytes(b"x")
        store.commit(ControllerState(step=step, prompts_drawn=step * 8))
    store.begin(4)  # crashed before commit: no controller_state.json
    assert [s for s, _ in run.checkpoints_by_step()] == [2, 3]
    state, train_dir = store.latest()  # type: ignore[misc]
    assert state.step == 3 and state.prompts_drawn == 24 and train_dir.name == "train"
    assert not run.checkpoint_dir(1).exists()


def test_jsonl_tolerates_cut_lines_and_truncates_after_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    for step in range(1, 6):
        append_jsonl(path, {"step": step, "reward_mean": step / 10})
    with open(path, "a") as fh:
        fh.write('{"step": 6, "rew')  # a crash mid-write
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5]
    assert truncate_jsonl_after_step(path, 3) == 2
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]


def test_desired_state_round_trip(tmp_path: Path) -> None:
    desired = DesiredState(rollout_instances=3, rollout_tp=2, train_gpus=4, train_layout=TrainLayout(tp=2, pp=2))
    desired = desired.evolve("plan", weight_version=7)
    desired.save(tmp_path / "desired.json")
    loaded = DesiredState.load(tmp_path / "desired.json")
    assert loaded == desired and loaded.generation == 1 and loaded.rollout_gpus == 6
    assert DesiredState.load(tmp_path / "missing.json") is None


def test_learning_curve_png(tmp_path: Path) -> None:
    rows = [{"step": s, "reward_mean": min(1.0, s / 20)} for s in range(1, 31)]
    rows[9]["eval_accuracy"] = 0.4
    out = tmp_path / "curve.png"
    assert plot_learning_curve(rows, out, "dev")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plot_learning_curve([], tmp_path / "empty.png")
    assert moving_average([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]


@pytest.mark.filterwarnings("ignore:No artists with labels")
def test_learning_curve_plots_overlapped_evaluations_at_their_step(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[tuple[float, float]] = []

    def record_plot(self: object, xs: list[float], ys: list[float], *args: object, **kwargs: object) -> None:
        if kwargs.get("label") == "held-out accuracy":
            drawn.extend(zip(xs, ys, strict=True))

    from matplotlib.axes import Axes

    monkeypatch.setattr(Axes, "plot", record_plot)
    rows = [{"step": s, "reward_mean": 0.5} for s in range(1, 12)]
    rows[5].update(eval_accuracy=0.25, eval_step=5)  # evaluated beside step 6's rollout
    rows[10].update(eval_accuracy=0.75)  # the last step evaluates in the foreground
    assert plot_learning_curve(rows, tmp_path / "curve.png")
    assert drawn == [(5, 0.25), (11, 0.75)]


def test_reporter_draws_the_curve_off_the_step_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = RunDir.at(tmp_path / "run").create()
    threads: list[str] = []
    release = threading.Event()

    def slow_plot(rows: list[dict[str, object]], path: Path, title: str = "") -> bool:
        threads.append(threading.current_thread().name)
        release.wait(10)
        return plot_learning_curve(rows, path, title)

    monkeypatch.setattr(reporting, "plot_learning_curve", slow_plot)
    events = EventLog(run.events_jsonl)
    reporter = Reporter(run, "t", 3, NullConsole(), events, None, curve_interval_s=0.0)
    reporter.step({"step": 1, "reward_mean": 0.2}, {}, {}, {})
    assert reporter.drawing_curve  # step() returned while the picture is still being drawn
    reporter.step({"step": 2, "reward_mean": 0.4}, {}, {}, {})  # no second drawing while one runs
    release.set()
    reporter.finish("finished")
    assert threads == ["libra-curve", threading.current_thread().name]
    assert run.learning_curve_png.read_bytes()[:4] == b"\x89PNG"


def _fake_run(tmp_path: Path, state: str, pid: int) -> RunDir:
    run = RunDir.at(tmp_path / "run").create()
    run.config_yaml.write_text("name: dev\n")
    write_json_atomic(run.status_json, {
        "name": "dev", "state": state, "pid": pid, "host": socket.gethostname(), "total_steps": 50,
        "updated_at": 0, "pools": {"rollout": {"gpus": 2, "desired_instances": 2, "members": {"READY": 2}},
                                   "train": {"gpus": 2, "layout": "TP1 PP1 CP1 EP1 DP2", "members": {"READY": 2}}},
    })
    for step in (1, 2, 3):
        append_jsonl(run.metrics_jsonl, {"step": step, "reward_mean": 0.1 * step, "time_step_s": 1.5})
    append_jsonl(run.events_jsonl, {"ts": 1.0, "kind": "weight_sync", "message": "sync_interval 1", "version": 3})
    store = CheckpointStore(run, 2, 0)
    store.begin(2)
    store.commit(ControllerState(step=2))
    return run


def test_status_command_text_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _fake_run(tmp_path, "running", os.getpid())
    assert main(["status", str(run.root)]) == 0
    out = capsys.readouterr().out
    assert "run dev" in out and ": running" in out
    assert "step 3/50" in out and "reward 0.300" in out
    assert "train pool: 2 GPUs, TP1 PP1 CP1 EP1 DP2" in out
    assert "checkpoints: 2" in out and "weight_sync: sync_interval 1" in out
    assert main(["status", str(run.root), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 3 and info["alive"] is True and info["checkpoints"] == [2]


def test_status_reports_a_dead_controller(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _fake_run(tmp_path, "running", 2**22 + 12345)
    assert main(["status", str(run.root)]) == 0
    assert "controller process gone" in capsys.readouterr().out


def test_status_rejects_a_non_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", str(tmp_path)]) == 2
    assert "is not a run directory" in capsys.readouterr().err
