"""Entry point of the `libra` command: builds the parser from the command modules and dispatches.

Each command lives in `libra/cli/cmd_<name>.py` and exposes `register(subparsers)`, which adds its
sub-parser and sets `func` (args -> exit code). A command module that is absent is simply not offered,
so `--help` lists only commands that work.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

COMMANDS = ("launch", "plan", "validate", "trace", "status", "reconfigure", "pause", "resume", "drain", "events",
            "simulate")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="libra", description="Elastic resource-planning runtime for RL post-training (GRPO family)."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"libra.cli.cmd_{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"libra.cli.cmd_{name}":
                continue
            raise
        module.register(sub)
    return parser


def quiet_grpc_logs(argv: list[str]) -> None:
    """gRPC's core logs at INFO on the console when a process forks while its threads run (Ray's start forks
    the driver: "Other threads are currently calling into gRPC, skipping fork() handlers"); only its errors
    show, unless --debug or the user's own GRPC_VERBOSITY. Set before any command module imports gRPC."""
    if "--debug" not in argv:
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def main(argv: list[str] | None = None) -> int:
    quiet_grpc_logs(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the CLI never shows a traceback unless asked
        if args.debug:
            traceback.print_exc()
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        if not args.debug:
            print("(run with --debug for the traceback)", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
