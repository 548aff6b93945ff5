"""`libra pause RUN_DIR`: hold a running job's RL loop at the next step boundary (through the job's operator API)."""

from __future__ import annotations

import argparse
from typing import Any

from libra.cli.operator_call import add_run_dir, control


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "pause", help="hold a running job's RL loop at the next step boundary",
        description="Hold the RL loop of the job in RUN_DIR before its next step (the step in flight finishes; the "
                    "rollout and training pools and the reconciler keep running, so the job can be reconfigured while "
                    "paused). Exit 0 when paused, 1 when refused.",
    )
    add_run_dir(parser)
    parser.add_argument("--reason", default="", help="free text recorded in the event log")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return control(args, "pause")
