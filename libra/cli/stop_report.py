"""The one line `libra launch` prints when a job ends: what ended it, at which step, which checkpoint holds
it, and the command that continues it. Every way a job can end (finished, interrupted by a signal, drained
by the operator, failed) gets exactly one such line; tracebacks are for `--debug`."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

_SIGNAL_NAMES = {"SIGINT": "Ctrl-C (SIGINT)", "SIGTERM": "SIGTERM"}


@dataclass(frozen=True)
class JobEnd:
    outcome: str  # finished | interrupted | drained | failed
    step: int  # the last completed step
    end_step: int  # the step the job was to reach
    stop_reason: str = ""  # SIGINT, SIGTERM, ... ("" = no stop was asked for)
    checkpoint_step: int | None = None  # the newest complete checkpoint of the run directory
    error: str = ""  # the failure, one line
    total_steps: int = 0  # the configuration's total_steps (end_step is lower under --max-steps)


def resume_command(config: str, run_dir: str, overrides: Sequence[str] = (), extra: Sequence[str] = ()) -> str:
    """The `libra launch` command line that continues the run (the same configuration and overrides); an
    `extra` override replaces the launch's own override of the same key instead of following it."""
    replaced = {_key(override) for override in extra}
    words = ["libra", "launch", config, "--run-dir", run_dir]
    for override in [*(o for o in overrides if _key(o) not in replaced), *extra]:
        words += ["--set", override]
    return " ".join(shlex.quote(word) for word in words)


def _key(override: str) -> str:
    return override.split("=", 1)[0].strip()


def _saved(end: JobEnd) -> str:
    if end.checkpoint_step is None:
        return "no checkpoint saved yet (a new launch starts from step 0)"
    return f"newest checkpoint: step {end.checkpoint_step}"


def stop_line(end: JobEnd, config: str, run_dir: str, overrides: Sequence[str] = (), debug: bool = False) -> str:
    """One line: what happened and how to go on."""
    resume = resume_command(config, run_dir, overrides)
    if end.outcome == "finished" and end.step < end.total_steps:
        return (f"libra: finished at step {end.step} (--max-steps); {_saved(end)}; continue to step "
                f"{end.total_steps} with: {resume}")
    if end.outcome == "finished":
        more = resume_command(config, run_dir, overrides, [f"total_steps={max(end.end_step, end.step) * 2}"])
        return (f"libra: finished at step {end.step}; {_saved(end)}; to train further raise total_steps: "
                f"{more}")
    if end.outcome == "interrupted":
        by = _SIGNAL_NAMES.get(end.stop_reason, end.stop_reason or "a stop request")
        return f"libra: stopped by {by} at step {end.step}; {_saved(end)}; resume with: {resume}"
    if end.outcome == "drained":
        return f"libra: drained by the operator at step {end.step}; {_saved(end)}; resume with: {resume}"
    hint = "" if debug else " (run with --debug for the traceback)"
    error = end.error.splitlines()[0] if end.error else "unknown error"
    return (f"libra: failed at step {end.step}: {error}; {_saved(end)}; after fixing the cause resume with: "
            f"{resume}{hint}")
