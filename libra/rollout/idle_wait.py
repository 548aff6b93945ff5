"""Tensor-parallel vLLM workers that nap between engine steps instead of spinning (CPU hosts only).

A vLLM worker of a TP > 1 server reads each engine step from a shared-memory queue. For a second after every read
it polls that queue in a loop that only calls `sched_yield`; after that it waits on the queue's notification
socket. On a GPU node the loop costs host cores nothing else needs. On a CPU host the workers share their cores
with the model's other processes and with everything else: in `benchmarks/results/tp_idle_wait.json` (a TP 2
server of a tiny model on 2 cores, a CPU-bound bystander beside it), the server took 1.428 cores (1.376 in its
two workers) while answering one request every 0.5 s and left the bystander 0.285 cores; answering requests back
to back, they starved the server's own engine core and API server to 1.186 requests/s.

Installed in the worker processes, the reader's loop sleeps `NAP_S` instead of yielding: the same server took
0.362 cores (0.254 in its workers) at the same pace, the bystander got 0.851, and back to back the server
answered 29.708 requests/s. A step reaches a napping worker at most `NAP_S` late. (Waiting on the socket right
after every read instead is not an option: the readers then missed notifications and each step waited for the
queue's 5 s recheck.)

`device_env` asks for it on CPU hosts (`IDLE_WAIT_ENV`); `worker_extension`, which vLLM imports in every worker
before the queues exist, installs it.
"""

from __future__ import annotations

import os
import time
from typing import Any

IDLE_WAIT_ENV = "LIBRA_VLLM_WORKERS_WAIT_IDLE"
NAP_S = 0.0005


def requested() -> bool:
    return os.environ.get(IDLE_WAIT_ENV) == "1"


def install() -> bool:
    """Make the shared-memory queues created from now on in this process wait idle; False if vLLM's queue
    module no longer has the hook this relies on (the workers then spin as vLLM ships them)."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    spin_condition: Any = getattr(shm_broadcast, "SpinCondition", None)
    if spin_condition is None or not hasattr(spin_condition, "wait"):
        return False
    if getattr(spin_condition, "libra_idle_wait", False):
        return True

    class IdleWaitCondition(spin_condition):  # type: ignore[misc, valid-type]
        libra_idle_wait = True

        def wait(self, timeout_ms: int | None = None) -> None:
            if self.is_reader and time.monotonic() <= self.last_read + self.busy_loop_s:
                time.sleep(NAP_S)
                return
            super().wait(timeout_ms)

    shm_broadcast.SpinCondition = IdleWaitCondition  # type: ignore[misc]
    return True
