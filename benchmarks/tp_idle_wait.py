"""What a TP 2 vLLM-CPU server costs the rest of the host between engine steps: vLLM's spinning workers
against Libra's idle wait (`libra/rollout/idle_wait.py`).

    python benchmarks/tp_idle_wait.py --out benchmarks/results/tp_idle_wait.json

Builds a tiny Llama locally (`libra.models.tiny`) and starts a TP 2 server with `ServerProcess.start`, the
path every rollout instance takes, twice: as Libra starts it (`idle_wait`), and with the idle-wait request
left out of the server's environment (`spin`, vLLM's workers as shipped). For each, three windows of
`--window-s` seconds:
  idle       no requests (after one warm-up request);
  paced      one small request (4 prompt tokens, n=2, 4 new tokens) every 0.5 s;
  streamed   the same request back to back.
In every window a bystander process (a pure-Python loop pinned to nothing) runs beside the server, as the
controller, Ray and the other servers of a job do.

Figures per arm and window: `requests_per_s`, `cores` (CPU seconds per second of each kind of server process:
`api_server`, `engine_core`, `worker_tp0`, `worker_tp1`, and their `total`), `bystander_cores` (how much of
the host the bystander got). The top level repeats the paced window's server cores and bystander share of
both arms and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server_bench import bystander, tiny_model, write_result  # noqa: E402

from libra.rollout import server as server_module  # noqa: E402
from libra.rollout.idle_wait import IDLE_WAIT_ENV  # noqa: E402
from libra.rollout.server import ServerLaunch, ServerProcess, pick_free_port  # noqa: E402

STARTUP_S = 600.0
PACE_S = 0.5
WINDOWS = ("idle", "paced", "streamed")
NOT_COVERED = [
    "vLLM-CPU on a shared 2-core machine, one TP 2 server of a tiny model (hidden 64, 2 layers): the decode step "
    "is short, so the share of time the workers would spin is large; a large model's steps leave less gap",
    "GPU servers: their workers spin on host cores that the model does not use; Libra leaves them as vLLM ships",
    "TP 1 servers run the model inside the engine-core process and have no worker queue",
]


@contextmanager
def vllm_as_shipped() -> Iterator[None]:
    """Start servers without the idle-wait request (the `spin` arm); everything else as Libra starts them."""
    original = server_module.device_env

    def without_idle_wait(*args: Any, **kwargs: Any) -> dict[str, str]:
        env = original(*args, **kwargs)
        env.pop(IDLE_WAIT_ENV, None)
        return env

    server_module.device_env = without_idle_wait
    try:
        yield
    finally:
        server_module.device_env = original


def kind(process: psutil.Process) -> str:
    name = process.name()
    if name.startswith("VLLM::Worker_TP"):
        return "worker_tp" + name.rsplit("TP", 1)[1]
    if name.startswith("VLLM::EngineCore"):
        return "engine_core"
    command = " ".join(process.cmdline())
    if "server_guard" in command:
        return "guard"
    if "resource_tracker" in command:
        return "resource_tracker"
    return "api_server"


def cpu_by_kind(root_pid: int) -> dict[int, tuple[str, float]]:
    found: dict[int, tuple[str, float]] = {}
    root = psutil.Process(root_pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
            found[process.pid] = (kind(process), times.user + times.system)
        except psutil.Error:
            continue
    return found


def request(port: int) -> None:
    body = json.dumps({"model": "libra-policy", "prompt": [5, 6, 7, 8], "max_tokens": 4, "n": 2,
                       "temperature": 1.0}).encode()  # fmt: skip
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as answer:
        answer.read()


def window(server: ServerProcess, mode: str, seconds: float) -> dict[str, Any]:
    before = cpu_by_kind(server.pid)
    start = time.time()
    requests = 0
    with bystander() as side_process:
        while time.time() - start < seconds:
            if mode == "idle":
                time.sleep(0.2)
                continue
            request(server.launch.port)
            requests += 1
            if mode == "paced":
                time.sleep(PACE_S)
        side_times = side_process.cpu_times()
    elapsed = time.time() - start
    after = cpu_by_kind(server.pid)
    cores: dict[str, float] = {}
    for pid, (name, used) in after.items():
        if pid in before:
            cores[name] = cores.get(name, 0.0) + (used - before[pid][1]) / elapsed
    cores = {name: round(value, 3) for name, value in sorted(cores.items())}
    cores["total"] = round(sum(cores.values()), 3)
    return {
        "window_s": round(elapsed, 2),
        "requests": requests,
        "requests_per_s": round(requests / elapsed, 3),
        "cores": cores,
        "bystander_cores": round((side_times.user + side_times.system) / elapsed, 3),
    }


def run_arm(model: str, root: str, arm: str, seconds: float) -> dict[str, Any]:
    launch = ServerLaunch(model_path=model, port=pick_free_port("127.0.0.1"), host="127.0.0.1", max_model_len=128,
                          kv_cache_bytes=64 * 2**20, tp_size=2, log_path=os.path.join(root, f"{arm}.log"))
    started = time.monotonic()
    server = ServerProcess.start(launch, ["0", "1"], device="cpu")
    try:
        server.wait_healthy(STARTUP_S)
        startup_s = time.monotonic() - started
        request(launch.port)  # warm-up: the first request builds what a step needs
        result: dict[str, Any] = {"startup_s": round(startup_s, 1)}
        for mode in WINDOWS:
            result[mode] = window(server, mode, seconds)
        result["stop_s"] = round(server.stop(), 2)
        return result
    finally:
        server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--window-s", type=float, default=15.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="libra-tp-idle-") as root:
        model = tiny_model(root)
        arms: dict[str, Any] = {}
        with vllm_as_shipped():
            arms["spin"] = run_arm(model, root, "spin", args.window_s)
        arms["idle_wait"] = run_arm(model, root, "idle_wait", args.window_s)
    paced = {arm: arms[arm]["paced"] for arm in arms}
    streamed = {arm: arms[arm]["streamed"] for arm in arms}
    result = {
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "tp_size": 2,
        "arms": arms,
        "paced_server_cores": {arm: paced[arm]["cores"]["total"] for arm in arms},
        "paced_bystander_cores": {arm: paced[arm]["bystander_cores"] for arm in arms},
        "paced_server_cores_ratio_spin_over_idle_wait": round(
            paced["spin"]["cores"]["total"] / max(paced["idle_wait"]["cores"]["total"], 1e-9), 2),
        "streamed_requests_per_s_ratio_idle_wait_over_spin": round(
            streamed["idle_wait"]["requests_per_s"] / max(streamed["spin"]["requests_per_s"], 1e-9), 3),
        "paced_requests_per_s_ratio_idle_wait_over_spin": round(
            paced["idle_wait"]["requests_per_s"] / max(paced["spin"]["requests_per_s"], 1e-9), 3),
        "not_covered": NOT_COVERED,
    }
    write_result(args.out, result, ("arms", "not_covered"))


if __name__ == "__main__":
    main()
