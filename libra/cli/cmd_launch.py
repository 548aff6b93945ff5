"""`libra launch CONFIG [--run-dir DIR] [--set KEY=VALUE ...] [--max-steps N]`: run a job.

Loads and validates the configuration (errors: exit 2), then runs the controller until the job is done
(exit 0), interrupted (Ctrl-C / SIGTERM: the current step finishes, a checkpoint is saved, every server and
worker is stopped; exit 130), drained (`libra drain`: the same after the step in flight, exit 0) or failed
(exit 1). Every end prints one line (`stop_report`): what happened and the command that continues the run;
tracebacks only with `--debug`. Launching on a run directory that already holds a run resumes it from its
newest checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any

from libra.cli.config_args import add_config_arguments, load_or_report
from libra.cli.stop_report import JobEnd, stop_line
from libra.config import ConfigError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INVALID = 2
EXIT_INTERRUPTED = 130


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "launch", help="run a job (or resume it)",
        description="Run the GRPO job described by CONFIG: plan the GPU split, start Ray, the rollout and "
                    "training pools, and train. On an existing run directory the run resumes from its newest "
                    "checkpoint.",
    )
    add_config_arguments(parser)
    parser.add_argument("--run-dir", metavar="DIR", default="",
                        help="run directory (default: run_dir of the configuration, runs/<name>)")
    parser.add_argument("--max-steps", type=int, default=0, metavar="N",
                        help="stop after global step N (the schedule still follows total_steps)")
    parser.add_argument("--console", choices=("rich", "plain", "off"), default="",
                        help="console view (default: tracking.console)")
    parser.add_argument("--keep-servers", action="store_true",
                        help="leave the rollout servers running at exit, for the next launch to adopt")
    # also accepted before the command (`libra --debug launch`); SUPPRESS keeps that value when absent here
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks (errors, aborted requests) on stderr; they are always in controller.log")
    parser.set_defaults(func=run)


def _setting_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "change the configuration" (exit 2) rather than "the job failed"."""
    from libra.controller.allocation import InfeasiblePlanError
    from libra.data.prompt import TaskError
    from libra.rollout.spec import RolloutSpecError
    from libra.training.spec import InvalidTrainingSpecError, NotValidatedOnCPUError

    return (ConfigError, InfeasiblePlanError, RolloutSpecError, InvalidTrainingSpecError, NotValidatedOnCPUError,
            TaskError)


def run(args: argparse.Namespace) -> int:
    from libra.controller import Controller, LaunchOptions
    from libra.run_dir import RunDir

    run_dir_override = [f"run_dir={os.path.abspath(args.run_dir)}"] if args.run_dir else []
    if args.max_steps < 0:
        print(f"error: --max-steps {args.max_steps}: must be >= 0 (0 = total_steps)", file=sys.stderr)
        return EXIT_INVALID
    cfg = load_or_report(args, run_dir_override)
    if cfg is None:
        return EXIT_INVALID
    for warning in cfg.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    run_dir = RunDir.at(cfg.run_dir)
    verb = "resuming" if run_dir.is_existing_run() else "starting"
    print(f"libra: {verb} {cfg.name} in {run_dir.root}", flush=True)
    debug = bool(getattr(args, "debug", False))
    options = LaunchOptions(max_steps=args.max_steps, console=args.console, keep_servers=args.keep_servers,
                            debug=debug)
    controller = Controller(cfg, run_dir, options)
    try:
        result = controller.run_job()
    except _setting_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as exc:  # the job failed: one line, the traceback only with --debug
        if debug:
            traceback.print_exc()
        end = JobEnd("failed", controller.step, controller.end_step, checkpoint_step=_newest_checkpoint(run_dir),
                     error=f"{type(exc).__name__}: {exc}", total_steps=cfg.total_steps)
        print(stop_line(end, args.config, str(run_dir.root), args.overrides, debug), file=sys.stderr, flush=True)
        return EXIT_FAILED
    end = JobEnd(result.outcome, result.step, controller.end_step, result.stop_reason,
                 _newest_checkpoint(run_dir), result.error, cfg.total_steps)
    line = stop_line(end, args.config, str(run_dir.root), args.overrides, debug)
    print(line, file=sys.stdout if result.outcome != "failed" else sys.stderr, flush=True)
    if result.outcome == "interrupted":
        return EXIT_INTERRUPTED
    return EXIT_OK if result.outcome in ("finished", "drained") else EXIT_FAILED


def _newest_checkpoint(run_dir: Any) -> int | None:
    found = run_dir.latest_checkpoint()
    return found[0] if found else None
