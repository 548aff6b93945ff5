"""`libra validate CONFIG [--set KEY=VALUE ...]`: load and validate a job configuration.

Prints a short summary of the resolved configuration and exits 0, or prints every error grouped by class
(Invalid configuration / Not implemented / Not validated) and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from libra.config import ConfigError, load
from libra.config.summary import summarize

EXIT_OK = 0
EXIT_INVALID = 2


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "validate", help="validate a job configuration",
        description="Load CONFIG with its --set overrides, check every option and cross-field rule, and print "
                    "the resolved configuration or every error (exit 2).",
    )
    parser.add_argument("config", metavar="CONFIG", help="YAML job file, e.g. configs/dev.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one option (dotted path, YAML value); repeatable, the last one wins")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load(args.config, args.overrides)
    except ConfigError as err:
        print(err.report(), file=sys.stderr)
        return EXIT_INVALID
    print(f"{args.config}: valid")
    for line in summarize(cfg):
        print(f"  {line}")
    return EXIT_OK
