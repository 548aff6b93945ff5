"""What every command that reads a job configuration shares: the CONFIG and `--set` arguments, and loading
with every configuration error printed (no traceback) and exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from libra.config import Config, ConfigError, load

EXIT_INVALID = 2


def add_config_arguments(parser: Any, example: str = "configs/dev.yaml") -> None:
    parser.add_argument("config", metavar="CONFIG", help=f"YAML job file, e.g. {example}")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one option (dotted path, YAML value); repeatable, the last one wins")


def load_or_report(args: argparse.Namespace, extra_overrides: Sequence[str] = (),
                   planning: bool = False) -> Config | None:
    """The loaded configuration, or None after printing every error to stderr (the caller exits 2).
    `planning`: for `libra plan`, which plans models Libra cannot run yet (those rules then only warn)."""
    try:
        return load(args.config, [*args.overrides, *extra_overrides], planning=planning)
    except ConfigError as err:
        print(err.report(), file=sys.stderr)
        return None
