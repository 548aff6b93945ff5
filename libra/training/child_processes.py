"""The processes a training worker forks end when the worker dies, however it dies (`kill -9` included).

Megatron-Core's checkpoint save forks writer processes. A forked child inherits the worker's connection to
Ray: while it lives, Ray does not see the worker die, and the collective call the worker was in (a checkpoint
save) waits forever instead of failing. So every child forked from a worker process is killed by the kernel
when the worker dies (`PR_SET_PDEATHSIG`).

Linux only; elsewhere nothing is set up.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h

_installed = False
_forking_pid = 0  # written in the parent just before each fork, read in the child


def _before_fork() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel kill this process when the thread that forked it ends (the worker's task thread ends
    only with the worker); exit at once if the parent is already gone."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError) as exc:  # no prctl: the child may outlive its worker
        log.debug("prctl(PR_SET_PDEATHSIG) unavailable: %s", exc)
        return
    if parent and os.getppid() != parent:
        os._exit(1)


def install_for_forks() -> None:
    """In a worker process: every child forked from now on dies with its parent (idempotent)."""
    global _installed
    if _installed or not sys.platform.startswith("linux"):
        return
    os.register_at_fork(before=_before_fork, after_in_child=lambda: die_with_parent(_forking_pid))
    _installed = True
