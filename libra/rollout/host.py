"""The owner of one instance's server process on the node where it runs.

`ServerHost` is a plain class: the pool runs it as a small Ray actor holding the instance's logical GPUs
(through `libra.cluster.rollout_hosts`), so the server inherits `CUDA_VISIBLE_DEVICES` from Ray; without
a Ray runtime it runs in the controller's process (`LocalHostHandle`). Either way the pool talks to it
through the same two calls: `call` (blocking) and `acall` (awaitable).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from dataclasses import replace
from typing import Any

from libra.metering.holder import GpuHolderSlice
from libra.metering.spec import CpuMetering
from libra.rollout.server import ServerLaunch, ServerProcess, pick_free_port, port_is_free
from libra.rollout.spec import NODE_IP, ServerStartError

PORT_ATTEMPTS = 3
# A fixed port can still be held by the server of this instance that an earlier controller's leftover host
# ran: killing that host stops its server, but the process takes a few seconds to exit and free the port.
PORT_RELEASE_WAIT_S = 30.0


def _wait_for_port(host: str, port: int, timeout_s: float, poll_s: float = 0.25) -> bool:
    """True once `port` is free on `host` (checked at once, then every `poll_s` until `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not port_is_free(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def _resolve_bind_host(bind_host: str) -> str:
    if bind_host != NODE_IP:
        return bind_host
    from libra.cluster.rollout_hosts import node_ip_address

    return node_ip_address()


class ServerHost:
    """Starts, restarts, adopts and stops the vLLM server of one instance; thread-safe."""

    def __init__(self, instance_id: str, bind_host: str = "127.0.0.1", tie_to_host: bool = False,
                 metering: CpuMetering | None = None) -> None:
        """`tie_to_host`: the server stops when this host's process dies (a Ray host actor holds the GPUs;
        without Ray the server must outlive the controller for adoption). `metering`: the server runs in a CPU
        slice of this host's logical GPUs (`libra.metering`)."""
        self.instance_id = instance_id
        self.host = _resolve_bind_host(bind_host)
        self._owner_pid = os.getpid() if tie_to_host else 0
        self._server: ServerProcess | None = None
        self._lock = threading.Lock()
        self._cpu = GpuHolderSlice(metering, instance_id)

    def identity(self) -> dict[str, Any]:
        """Where this host runs: address, hostname and the GPU ids Ray gave it."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return {
            "host": self.host,
            "hostname": socket.gethostname(),
            "gpu_ids": [g for g in visible.split(",") if g.strip()],
            "host_pid": os.getpid(),
        }

    def start(self, launch: ServerLaunch, timeout_s: float) -> dict[str, Any]:
        """Start the server (port 0 = a free port on this node) and wait for /health."""
        with self._lock:
            if self._server is not None and self._server.alive():
                raise RuntimeError(
                    f"instance {self.instance_id} already runs a server (pid {self._server.pid})"
                )
            launch = replace(launch, host=self.host)
            pick_port = launch.port == 0
            if not pick_port and not _wait_for_port(self.host, launch.port, PORT_RELEASE_WAIT_S):
                raise RuntimeError(
                    f"port {launch.port} on {self.host} is still in use after {PORT_RELEASE_WAIT_S:.0f}s; "
                    "choose another port_base or free the port"
                )
            start = time.monotonic()
            for attempt in range(PORT_ATTEMPTS if pick_port else 1):
                if pick_port:
                    launch = replace(launch, port=pick_free_port(self.host))
                self._server = ServerProcess.start(
                    launch, self.identity()["gpu_ids"], owner_pid=self._owner_pid
                )
                self._cpu.hold(self._server.pid)
                try:
                    self._server.wait_healthy(timeout_s)
                    break
                except ServerStartError as exc:
                    # A free port can be taken between picking and binding; pick again.
                    if (
                        attempt + 1 < PORT_ATTEMPTS
                        and pick_port
                        and "address already in use" in str(exc).lower()
                    ):
                        continue
                    raise
            return self._describe(startup_s=time.monotonic() - start)

    def adopt(self, launch: ServerLaunch, pid: int, start_ticks: int) -> bool:
        """Take over a server started by an earlier controller, if that exact process still runs."""
        with self._lock:
            candidate = ServerProcess.attach(replace(launch, host=self.host), pid, start_ticks)
            if not candidate.alive():
                return False
            self._server = candidate
            return True

    def restart(self, model_path: str, timeout_s: float, stop_timeout_s: float) -> dict[str, Any]:
        """Replace the server process by one loading `model_path` on the same port."""
        with self._lock:
            if self._server is None:
                raise RuntimeError(f"instance {self.instance_id} has no server to restart")
            launch = self._server.launch.with_model(model_path)
            process_stop_s = self._server.stop(stop_timeout_s)
            _wait_for_port(self.host, launch.port, 10.0, poll_s=0.1)
            start = time.monotonic()
            self._server = ServerProcess.start(launch, self.identity()["gpu_ids"], owner_pid=self._owner_pid)
            self._cpu.hold(self._server.pid)
            self._server.wait_healthy(timeout_s)
            return self._describe(process_stop_s=process_stop_s, startup_s=time.monotonic() - start)

    def stop(self, timeout_s: float) -> float:
        with self._lock:
            if self._server is None:
                return 0.0
            elapsed = self._server.stop(timeout_s)
            self._cpu.release()
            self._server = None
            return elapsed

    def abandon(self) -> int:
        """Kill the server now, without waiting for a start or restart in progress (it holds the lock until the
        server is healthy): for the host of a start that a killed controller left unfinished, whose server
        nothing will adopt. The start in progress then fails. Returns the pid killed, 0 if none ran."""
        server = self._server
        if server is None or not server.alive():
            return 0
        server.kill()
        return server.pid

    def status(self) -> dict[str, Any]:
        server = self._server
        return {"alive": bool(server and server.alive()), "pid": server.pid if server else 0}

    def _describe(self, **timings: float) -> dict[str, Any]:
        assert self._server is not None
        server = self._server
        return {
            "pid": server.pid,
            "start_ticks": server.start_ticks,
            "host": server.launch.host,
            "port": server.launch.port,
            "log_path": server.launch.log_path,
            "model_path": server.launch.model_path,
            **timings,
        }


class LocalHostHandle:
    """A `ServerHost` in this process (no Ray): the same call interface as a host actor."""

    def __init__(self, host: ServerHost, name: str) -> None:
        self.name = name
        self._host = host

    def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return getattr(self._host, method)(*args)

    async def acall(self, method: str, *args: Any) -> Any:
        return await asyncio.to_thread(getattr(self._host, method), *args)

    def kill(self) -> None:
        """Nothing to release: the host lives in this process."""
