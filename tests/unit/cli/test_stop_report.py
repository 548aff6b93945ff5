"""Every end of `libra launch` prints one line (what happened, how to go on) and no traceback unless
`--debug`; the exit code follows the outcome."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import pytest

from libra.cli.main import main
from libra.cli.stop_report import JobEnd, resume_command, stop_line

REPO = Path(__file__).resolve().parents[3]
DEV_CONFIG = str(REPO / "configs" / "dev.yaml")


@pytest.mark.parametrize(
    ("end", "expected"),
    [
        (JobEnd("finished", 40, 40, checkpoint_step=40, total_steps=40),
         ["finished at step 40;", "checkpoint: step 40", "--set total_steps=80"]),
        (JobEnd("finished", 6, 6, checkpoint_step=6, total_steps=100),
         ["finished at step 6 (--max-steps)", "continue to step 100 with: libra launch"]),
        (JobEnd("interrupted", 11, 100, "SIGINT", 11), ["stopped by Ctrl-C (SIGINT) at step 11",
                                                        "checkpoint: step 11", "resume with: libra launch"]),
        (JobEnd("interrupted", 7, 100, "SIGTERM", 6), ["stopped by SIGTERM at step 7", "checkpoint: step 6"]),
        (JobEnd("interrupted", 0, 100, "SIGINT", None), ["at step 0", "no checkpoint saved yet"]),
        (JobEnd("drained", 5, 100, "", 5), ["drained by the operator at step 5", "resume with:"]),
        (JobEnd("failed", 3, 100, "", 2, "RuntimeError: boom\nsecond line"),
         ["failed at step 3: RuntimeError: boom;", "checkpoint: step 2", "--debug for the traceback"]),
    ],
    ids=["finished", "finished-max-steps", "sigint", "sigterm", "sigint-before-any-checkpoint", "drained", "failed"],
)
def test_one_line_per_end(end: JobEnd, expected: list[str]) -> None:
    line = stop_line(end, "job.yaml", "/runs/a b", ["optimizer.lr=1e-4"])
    assert "\n" not in line and line.startswith("libra: ")
    for text in expected:
        assert text in line, (text, line)
    assert "--run-dir '/runs/a b' --set optimizer.lr=1e-4" in line


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["total_steps=2"], ["--set", "total_steps=4"]),
        (["optimizer.lr=1e-4", " total_steps =2"], ["--set", "optimizer.lr=1e-4", "--set", "total_steps=4"]),
        (["optimizer.lr=1e-4"], ["--set", "optimizer.lr=1e-4", "--set", "total_steps=4"]),
    ],
    ids=["the-launch-set-it", "the-launch-set-it-among-others", "the-launch-did-not-set-it"],
)
def test_raising_total_steps_replaces_the_launchs_own_override(overrides: list[str], expected: list[str]) -> None:
    line = stop_line(JobEnd("finished", 2, 2, checkpoint_step=2, total_steps=2), "job.yaml", "/r", overrides)
    assert shlex.split(line.split("raise total_steps: ", 1)[1]) == ["libra", "launch", "job.yaml", "--run-dir", "/r",
                                                                    *expected]


def test_resume_command_round_trips_through_a_shell() -> None:
    command = resume_command("my job.yaml", "/r", ["task.name=a b", "x=$(rm -rf /)"])
    assert shlex.split(command) == ["libra", "launch", "my job.yaml", "--run-dir", "/r", "--set", "task.name=a b",
                                    "--set", "x=$(rm -rf /)"]


def _fake_run_job(outcome: Any) -> Any:
    def run_job(self: Any) -> Any:
        from libra.controller.controller import RunResult

        if isinstance(outcome, BaseException):
            raise outcome
        return RunResult(outcome, 0, 0, stop_reason="SIGTERM" if outcome == "interrupted" else "")

    return run_job


@pytest.mark.parametrize(
    ("outcome", "argv_debug", "code", "traceback_shown"),
    [
        ("finished", [], 0, False),
        ("drained", [], 0, False),
        ("interrupted", [], 130, False),
        (RuntimeError("the training pool died"), [], 1, False),
        (RuntimeError("the training pool died"), ["--debug"], 1, True),
        (RuntimeError("the training pool died"), ["global-debug"], 1, True),
    ],
    ids=["finished", "drained", "interrupted", "failed", "failed-debug", "failed-global-debug"],
)
def test_launch_exit_code_and_quiet_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    outcome: Any, argv_debug: list[str], code: int, traceback_shown: bool,
) -> None:  # fmt: skip
    from libra.controller import Controller

    monkeypatch.setattr(Controller, "run_job", _fake_run_job(outcome))
    monkeypatch.setenv("GRPC_VERBOSITY", "")  # recorded, so what main() sets is undone after the test
    monkeypatch.delenv("GRPC_VERBOSITY")
    prefix = ["--debug"] if argv_debug == ["global-debug"] else []
    suffix = [] if argv_debug == ["global-debug"] else argv_debug
    assert main([*prefix, "launch", DEV_CONFIG, "--run-dir", str(tmp_path / "run"), *suffix]) == code
    out = capsys.readouterr()
    stop_lines = [line for line in (out.out + out.err).splitlines() if line.startswith("libra: ") and ";" in line]
    assert len(stop_lines) == 1, out
    assert ("Traceback" in out.err) is traceback_shown
    assert f"--run-dir {tmp_path / 'run'}" in stop_lines[0]


@pytest.mark.parametrize(
    ("argv", "preset", "expected"),
    [
        (["launch", "job.yaml"], None, "ERROR"),
        (["--debug", "launch", "job.yaml"], None, None),
        (["launch", "job.yaml", "--debug"], None, None),
        (["launch", "job.yaml"], "DEBUG", "DEBUG"),
    ],
    ids=["quiet-by-default", "global-debug-keeps-them", "launch-debug-keeps-them", "the-users-own-setting-wins"],
)
def test_grpc_fork_messages_stay_off_the_console(monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                 preset: str | None, expected: str | None) -> None:
    from libra.cli.main import quiet_grpc_logs

    monkeypatch.setenv("GRPC_VERBOSITY", preset or "")  # recorded, so the test's setting is undone after it
    if preset is None:
        monkeypatch.delenv("GRPC_VERBOSITY")
    quiet_grpc_logs(argv)
    assert os.environ.get("GRPC_VERBOSITY") == expected
