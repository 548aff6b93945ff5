"""The processes a training worker starts end when the worker dies, however it dies (`kill -9` included).

Megatron-Core's checkpoint save forks writer processes, and its write-results queue lives in a spawned
manager process. A forked child inherits the worker's connection to Ray: while it lives, Ray does not see the
worker die, and the collective call the worker was in (a checkpoint save) waits forever instead of failing.
So every child forked from a worker process is killed by the kernel when the worker dies
(`PR_SET_PDEATHSIG`), and the spawned queue manager exits once it finds itself orphaned.

Linux only; elsewhere nothing is set up.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h
ORPHAN_POLL_S = 1.0

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


def exit_when_orphaned() -> None:
    """In a spawned helper process (its initializer): exit once its parent has died. A thread polls the parent,
    because a kernel death signal would follow the parent's thread that spawned the helper, which may be a
    short-lived one."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="libra-exit-when-orphaned", daemon=True).start()


def start_checkpoint_results_queue() -> None:
    """Create Megatron-Core's checkpoint write-results queue (a spawned manager process) as one that exits
    when this worker dies, before Megatron creates its own; nothing happens when it already exists."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # private in megatron-core 0.16.1: the module's queue, created on first use by every save
    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=exit_when_orphaned)
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive
