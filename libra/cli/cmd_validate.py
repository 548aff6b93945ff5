"""`libra validate CONFIG [--set KEY=VALUE ...]`: load and validate a job configuration.

Prints a short summary of the resolved configuration and exits 0, or prints every error grouped by class
(Invalid configuration / Not implemented / Not validated) and exits 2.
"""

from __future__ import annotations

import argparse
from typing import Any

from libra.cli.config_args import EXIT_INVALID, add_config_arguments, load_or_report
from libra.config.summary import summarize

EXIT_OK = 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "validate", help="validate a job configuration",
        description="Load CONFIG with its --set overrides, check every option and cross-field rule, and print "
                    "the resolved configuration or every error (exit 2).",
    )
    add_config_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = load_or_report(args)
    if cfg is None:
        return EXIT_INVALID
    print(f"{args.config}: valid")
    for line in summarize(cfg):
        print(f"  {line}")
    return EXIT_OK
