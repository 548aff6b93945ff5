"""Finding a vLLM server's engine core among its processes, for the tests that stop or kill the engine alone
(the rollout pool's engine-hang test and the server-fault rig)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import psutil

ENGINE_CORE_TITLE = "VLLM::EngineCore"  # the title vLLM gives its engine core process once it runs


def engine_core_pid(processes: Callable[[], Iterable[int]], owner: str, timeout_s: float = 30.0) -> int:
    """The pid of the one process titled `VLLM::EngineCore` among `processes()` (the server `owner`'s), asked
    again every half second for up to `timeout_s`; the error names each of them with its state and command."""
    deadline = time.monotonic() + timeout_s
    while True:
        found: dict[int, tuple[str, str]] = {}  # pid: (state, command line)
        for pid in processes():
            try:
                process = psutil.Process(pid)
                found[pid] = (process.status(), " ".join(process.cmdline())[:160])
            except psutil.Error:
                continue
        engines = [pid for pid, (_, command) in found.items() if command.startswith(ENGINE_CORE_TITLE)]
        if len(engines) == 1:
            return engines[0]
        assert time.monotonic() < deadline, f"no single engine core among the processes of {owner}: {found}"
        time.sleep(0.5)
