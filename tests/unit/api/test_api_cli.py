"""The CLI contract of the commands that talk to a running job, against the in-process API of a fake-pool job:
exit 0 accepted / 2 invalid / 1 refused, each with a one-line reason; status --json keys; events."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from libra.api.server import start_operator_api
from libra.cli.main import main
from libra.run_dir import write_json_atomic

from .fake_job import FakeJob


@pytest.fixture
def job(tmp_path: Path) -> Iterator[FakeJob]:
    fake = FakeJob(tmp_path)
    write_json_atomic(fake.run.status_json, {"name": "dev", "state": "running", "step": 3, "total_steps": 10})
    server = start_operator_api(fake)
    assert server is not None
    yield fake
    server.stop()
    fake.close()


def run_dir(job: FakeJob) -> str:
    return str(job.run.root)


@pytest.mark.parametrize(("args", "code", "first_line"), [
    (["--set", "rollout_gpus=1"], 0, "accepted: generation 1"),
    (["--set", "rollout_gpus=1", "--dry-run"], 0, "dry run: generation 1"),
    (["--set", "rollout_gpus=9"], 2, "invalid: 1 problem"),
    (["--set", "rolout_gpus=1", "--set", "batch_size=2"], 2, "invalid: 2 problems"),
    (["--set", "rollout_gpus=2"], 1, "refused: the rollout pool already is 2 instances"),
    (["--strategy", "nope", "--set", "rollout_gpus=1"], 2, "invalid: 1 problem"),
], ids=["accepted", "dry-run", "invalid", "invalid-two", "refused-no-change", "invalid-strategy"])
def test_reconfigure_exit_codes(job: FakeJob, capsys: pytest.CaptureFixture[str], args: list[str], code: int,
                                first_line: str) -> None:
    assert main(["reconfigure", run_dir(job), *args]) == code
    out = capsys.readouterr()
    text = (out.out if code == 0 else out.err).splitlines()
    assert text[0].startswith(first_line), text


def test_reconfigure_wait_until_applied(job: FakeJob, capsys: pytest.CaptureFixture[str]) -> None:
    import threading

    ticking = threading.Event()

    def reconcile() -> None:
        while not ticking.wait(0.2):
            job.settle(2)

    thread = threading.Thread(target=reconcile, daemon=True)
    thread.start()
    try:
        assert main(["reconfigure", run_dir(job), "--set", "rollout_gpus=1", "--wait", "--timeout", "30"]) == 0
    finally:
        ticking.set()
        thread.join()
    assert capsys.readouterr().out.splitlines()[-1].startswith("applied: generation 1")


def test_second_request_refused_while_one_runs(job: FakeJob, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reconfigure", run_dir(job), "--set", "rollout_gpus=1"]) == 0
    assert main(["reconfigure", run_dir(job), "--set", "rollout_gpus=2"]) == 1
    assert "another reconfiguration is running" in capsys.readouterr().err


def test_not_running_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reconfigure", str(tmp_path), "--set", "rollout_gpus=1"]) == 1
    assert main(["pause", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("refused: no running job")


def test_pause_resume_drain(job: FakeJob, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pause", run_dir(job)]) == 0 and job.step_gate.paused
    assert main(["pause", run_dir(job)]) == 1
    assert main(["resume", run_dir(job)]) == 0 and not job.step_gate.paused
    assert main(["drain", run_dir(job)]) == 0 and job.step_gate.drain_requested
    assert main(["reconfigure", run_dir(job), "--set", "rollout_gpus=1"]) == 1
    assert "draining" in capsys.readouterr().err


def test_status_json_from_the_live_job(job: FakeJob, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reconfigure", run_dir(job), "--set", "rollout_gpus=1"]) == 0
    job.settle()
    capsys.readouterr()
    assert main(["status", run_dir(job), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["live"] is True and info["state"] == "running" and info["step"] == 3
    assert (info["rollout_gpus"], info["rollout_instances"], info["rollout_tp_size"], info["train_gpus"]) == (1, 1, 1, 2)
    assert info["train_layout"].startswith("TP1") and "checkpoints" in info and "events" in info
    assert info["last_reconfiguration"]["request"] == ["rollout_gpus=1"]
    assert info["last_reconfiguration"]["state"] == "done"


def test_status_json_from_the_run_directory(job: FakeJob, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reconfigure", run_dir(job), "--set", "rollout_gpus=1"]) == 0
    job.settle()
    (job.run.root / "api_address.json").unlink()  # as after the job stopped
    capsys.readouterr()
    assert main(["status", run_dir(job), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["live"] is False and info["rollout_instances"] == 1
    assert info["last_reconfiguration"]["state"] == "done"


def test_events(job: FakeJob, capsys: pytest.CaptureFixture[str]) -> None:
    job.events.emit("marker", "hello")
    assert main(["events", run_dir(job), "--last", "1"]) == 0
    assert capsys.readouterr().out.strip().endswith("marker: hello")
