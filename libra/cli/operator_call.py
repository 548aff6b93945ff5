"""What the commands that talk to a running job share (`libra reconfigure / pause / resume / drain / events /
status`): finding the job from RUN_DIR, the exit codes, and printing a refusal as one line."""

from __future__ import annotations

import sys
from typing import Any

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_INVALID = 2


def add_run_dir(parser: Any) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory of the job (e.g. runs/dev)")


def connect(run_dir: str) -> Any:
    """The job's operator client, or None after printing why there is none (the caller exits 1)."""
    from libra.api.auth import TokenUnreadable
    from libra.api.client import JobNotRunning, OperatorClient

    try:
        return OperatorClient.for_run_dir(run_dir)
    except (JobNotRunning, TokenUnreadable) as exc:
        refuse(str(exc))
        return None


def refuse(reason: str) -> int:
    print(f"refused: {reason}", file=sys.stderr)
    return EXIT_REFUSED


def rpc_failure(exc: Exception) -> int:
    """A call the job answered with an error status (UNAUTHENTICATED, INTERNAL, ...), or that found no job."""
    import grpc

    from libra.api.client import JobNotRunning

    if isinstance(exc, JobNotRunning):
        return refuse(str(exc))
    if isinstance(exc, grpc.RpcError):
        return refuse(f"{exc.code().name}: {exc.details()}")
    raise exc


def control(args: Any, call: str) -> int:
    """pause / resume / drain: one call, one line."""
    client = connect(args.run_dir)
    if client is None:
        return EXIT_REFUSED
    with client:
        try:
            reply = getattr(client, call)(args.reason)
        except Exception as exc:
            return rpc_failure(exc)
    if not reply.ok:
        return refuse(f"{reply.message} (state {reply.state})")
    print(f"{call}: {reply.message} (state {reply.state})")
    return EXIT_OK
