"""`libra resume RUN_DIR`: let a paused job continue (through the job's operator API)."""

from __future__ import annotations

import argparse
from typing import Any

from libra.cli.operator_call import add_run_dir, control


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "resume", help="let a paused job continue",
        description="Let the paused RL loop of the job in RUN_DIR continue. Exit 0 when resumed, 1 when refused (not "
                    "paused, job not running).",
    )
    add_run_dir(parser)
    parser.add_argument("--reason", default="", help="free text recorded in the event log")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return control(args, "resume")
