"""Guard of one vLLM server's process group (standard library only; runs as its own small process).

    python -m libra.rollout.server_guard [--owner-pid PID] -- <server command ...>

The guard leads the server's session and runs the server as its child. When the server exits, the guard
kills whatever is left in the group (vLLM's engine core outlives a killed API server otherwise, holding its
memory and cores) and exits with the server's code. With `--owner-pid`, it also stops the server when that
owner (the Ray host actor that holds the instance's GPUs) is gone, so no server runs on GPUs nobody holds.
SIGTERM/SIGINT sent to the guard alone are passed on to the server. If the guard itself is killed (Ray kills
the child processes of a killed host actor, the guard among them), the kernel sends the server SIGTERM
(`PR_SET_PDEATHSIG`), so a server is never left running without its guard.

A TP-1 CPU server's guard is instead forked from its node's server forker (`server_forker`), which imported the
server's modules once, and forks the server from itself: the same loop (`guard`) watches a `ForkedChild`, and
the owner, not the guard's parent, by its pid and start time.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Protocol

from libra.proc_stat import group_members

STOP_GRACE_S = 10.0


PR_SET_PDEATHSIG = 1


def stop_with_parent() -> None:
    """In the server's process, before it runs: SIGTERM when the guard (its parent) dies. Linux only; where
    prctl is unavailable the guard's own checks still apply."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def kill_rest_of_group() -> None:
    me = os.getpid()
    for pid in group_members(os.getpgrp()):
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class ServerChild(Protocol):
    """What the guard needs of its server process: `subprocess.Popen`, or `ForkedChild` for a server forked
    from a process that imported it already (`libra.rollout.server_forker`)."""

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class ForkedChild:
    """A child process made with `os.fork`, with the part of `subprocess.Popen`'s interface the guard uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def parent_is_not(owner_pid: int) -> Callable[[], bool]:
    """For a guard started by its owner: the owner is gone once the guard's parent changes."""
    return lambda: os.getppid() != owner_pid


def guard(start: Callable[[], ServerChild], owner_pid: int, owner_gone: Callable[[], bool] | None,
          poll_s: float = 1.0) -> int:
    """Start the server with `start` and guard it until it exits or `owner_gone()` (whether process
    `owner_pid` is gone) turns true, then stop it;
    clear the process group and return the server's exit status (128 + signal for a killed server)."""
    # The handlers are in place before the server starts: a signal that arrives while it starts is kept and
    # passed on once it runs (the default SIGINT handler would end the guard inside Popen, server left alive).
    started: list[ServerChild] = []
    pending: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if not started:
            pending.append(signum)
        elif started[0].poll() is None:
            started[0].send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    child = start()
    started.append(child)
    for signum in pending:
        if child.poll() is None:
            child.send_signal(signum)
    while True:
        try:
            code = child.wait(timeout=poll_s)
            reason = f"server exited with code {code}"
            break
        except subprocess.TimeoutExpired:
            pass
        if owner_gone is not None and owner_gone():
            child.terminate()
            try:
                code = child.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
                code = child.wait()
            reason = f"owner process {owner_pid} is gone; server stopped"
            break
    print(
        f"[libra server guard] {reason}; clearing process group {os.getpgrp()}", file=sys.stderr, flush=True
    )
    kill_rest_of_group()
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="run a vLLM server and keep its process group tidy")
    parser.add_argument(
        "--owner-pid", type=int, default=0, help="stop the server when this parent process is gone"
    )
    parser.add_argument("--poll-s", type=float, default=1.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no server command given after --")
    return guard(lambda: subprocess.Popen(command, preexec_fn=stop_with_parent), args.owner_pid,
                 parent_is_not(args.owner_pid) if args.owner_pid else None, args.poll_s)


if __name__ == "__main__":
    sys.exit(main())
