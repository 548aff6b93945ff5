"""`libra launch CONFIG [--run-dir DIR] [--set KEY=VALUE ...] [--max-steps N]`: run a job.

Loads and validates the configuration (errors: exit 2), then runs the controller until the job is done,
interrupted (Ctrl-C / SIGTERM: the current step finishes, a checkpoint is saved, every server and worker
is stopped; exit 130), drained (`libra drain`: the same after the step in flight, exit 0) or failed (exit 1). Launching on a run directory that already holds a run resumes it
from its newest checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from libra.cli.config_args import add_config_arguments, load_or_report
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
    options = LaunchOptions(max_steps=args.max_steps, console=args.console, keep_servers=args.keep_servers)
    try:
        result = Controller(cfg, run_dir, options).run_job()
    except _setting_errors() as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID
    print(f"libra: {result.outcome} at step {result.step} (run directory {run_dir.root})", flush=True)
    if result.outcome == "interrupted":
        print(f"libra: resume with: libra launch {args.config} --run-dir {run_dir.root}", flush=True)
        return EXIT_INTERRUPTED
    return EXIT_OK if result.outcome in ("finished", "drained") else EXIT_FAILED
