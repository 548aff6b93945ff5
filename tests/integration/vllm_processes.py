"""Finding a vLLM server's engine core among its processes, for the tests that stop or kill the engine alone
(the rollout pool's engine-hang test and the server-fault rig)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import psutil

ENGINE_CORE_TITLE = "VLLM::EngineCore"  # the title vLLM gives its engine core process once it runs


def engine_core_pid(processes: Callable[[], Iterable[int]], owner: str, timeout_s: float = 30.0) -> int:
    """The pid of the server `owner`'s engine core among `processes()` (its processes), asked again every half
    second for up to `timeout_s`: the one process titled `VLLM::EngineCore` (in its command line, or in its
    kernel name where setproctitle could not rewrite the command line), else the one process forked from its
    parent without a title of its own (an engine core forked from the API server keeps the API server's
    command line until it retitles itself, and one run met a forked engine core that served with no title).
    The error names each process with its state, name and command."""
    deadline = time.monotonic() + timeout_s
    while True:
        found: dict[int, tuple[str, str, str]] = {}  # pid: (state, kernel name, command line)
        forked: list[int] = []
        for pid in processes():
            try:
                process = psutil.Process(pid)
                command = " ".join(process.cmdline())
                found[pid] = (process.status(), process.name(), command[:160])
                if command and command == " ".join(psutil.Process(process.ppid()).cmdline()):
                    forked.append(pid)
            except psutil.Error:
                continue
        titled = [pid for pid, (_, name, command) in found.items()
                  if command.startswith(ENGINE_CORE_TITLE) or name.startswith(ENGINE_CORE_TITLE[:15])]
        if len(titled) == 1:
            return titled[0]
        if not titled and len(forked) == 1:
            return forked[0]
        assert time.monotonic() < deadline, f"no single engine core among the processes of {owner}: {found}"
        time.sleep(0.5)
