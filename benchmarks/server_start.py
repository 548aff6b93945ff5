"""How long a TP-1 vLLM-CPU server takes to start, and what it costs: forked from the node's server forker
(`libra/rollout/server_forker.py`, which imported vLLM's server once; how Libra starts it), started in a new
interpreter with its engine core forked from the API server (`libra/rollout/forked_engine_main.py`), and as
vLLM's CPU platform ships it (engine core spawned).

    python benchmarks/server_start.py --out benchmarks/results/server_start.json

Builds a tiny Llama locally (`libra.models.tiny`) and starts TP-1 servers with `ServerProcess.start`, the path
every rollout instance takes (replacements and reconfigurations included), alternating the three arms
(`forker`: the defaults; `fork`: `ServerLaunch.fork_from_forker` False; `spawn`: `fork_engine_core` False too),
`--repeats` times each, on an idle host and beside a CPU-bound bystander (a pure-Python loop, as the controller,
Ray and other servers of a running job load the host). Each condition starts its own forker: the first `forker`
start of a condition waits for its import and is reported apart (`first_start`); later ones are the starts a
job's second and later servers on a node, replacements and restart reloads make.

Figures per arm and host condition: `healthy_s` (from `ServerProcess.start` to the first `/health` 200, each
start, and their median), `cpu_s` (CPU-seconds the server's processes had used when it was healthy: guard, API
server, engine core; for the forker arm not the forker's import, which `forker_import_cpu_s` gives once per
condition), `group_pss_mib` (proportional memory of the server's process group once healthy), `answer` (the
text of one greedy request, the same in every arm when they compute the same). Top level: the median ratios
against `spawn` and `fork`.
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

from libra.proc_stat import group_members  # noqa: E402
from libra.rollout import forker_client  # noqa: E402
from libra.rollout.server import ServerLaunch, ServerProcess, pick_free_port  # noqa: E402

STARTUP_S = 600.0
ARMS = ("spawn", "fork", "forker")
NOT_COVERED = [
    "a tiny model (hidden 64, 2 layers): the model load and KV-cache set-up are short, so the imports a fork "
    "saves are a large share of the start; a large model's start adds its load time to both arms alike",
    "TP > 1 CPU servers and GPU servers: they start as vLLM ships (spawned workers on CPU; vLLM forks on GPU "
    "already unless CUDA is initialized), in a new interpreter",
    "the forker's memory: it holds the imported modules (its resident memory is given once per condition), "
    "shared with the servers it forked until they write to it",
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


def group_cpu_s(pgid: int) -> float:
    total = 0.0
    for pid in group_members(pgid):
        try:
            times = psutil.Process(pid).cpu_times()
        except (psutil.Error, OSError):
            continue
        total += times.user + times.system
    return round(total, 2)


def start_once(model: str, logs: str, arm: str, index: int) -> dict[str, Any]:
    launch = ServerLaunch(model_path=model, port=pick_free_port("127.0.0.1"), host="127.0.0.1", max_model_len=64,
                          kv_cache_bytes=64 * 2**20, tp_size=1, fork_engine_core=arm != "spawn",
                          fork_from_forker=arm == "forker", log_path=os.path.join(logs, f"{arm}-{index}.log"))
    forkers_before = len(forker_client._started)
    started = time.monotonic()
    server = ServerProcess.start(launch, ["0"], device="cpu")
    try:
        server.wait_healthy(STARTUP_S)
        healthy_s = time.monotonic() - started
        return {"healthy_s": round(healthy_s, 2), "cpu_s": group_cpu_s(server.pid),
                "group_pss_mib": group_pss_mib(server.pid), "answer": greedy_answer(launch.port),
                "started_the_forker": len(forker_client._started) > forkers_before, "stop_s": round(server.stop(), 2)}
    finally:
        server.kill()


def stop_forkers() -> dict[str, float]:
    """Stop the forkers this process started; their CPU-seconds and resident memory (MiB) before the stop."""
    seen: dict[str, float] = {"forker_import_cpu_s": 0.0, "forker_rss_mib": 0.0}
    for path, process in list(forker_client._started.items()):
        try:
            info = psutil.Process(process.pid)
            times = info.cpu_times()
            seen["forker_import_cpu_s"] += round(times.user + times.system, 2)
            seen["forker_rss_mib"] += round(info.memory_info().rss / 2**20, 1)
        except psutil.Error:
            pass
        process.kill()
        process.wait()
        del forker_client._started[path]
    return seen


def summary(starts: list[dict[str, Any]]) -> dict[str, Any]:
    later = [s for s in starts if not s["started_the_forker"]]
    first = [s for s in starts if s["started_the_forker"]]
    return {
        "healthy_s": [s["healthy_s"] for s in later],
        "healthy_s_median": round(statistics.median(s["healthy_s"] for s in later), 2),
        "cpu_s_median": round(statistics.median(s["cpu_s"] for s in later), 2),
        "group_pss_mib_median": round(statistics.median(s["group_pss_mib"] for s in later), 1),
        "answers": sorted({s["answer"] for s in starts}),
        **({"first_start": {k: first[0][k] for k in ("healthy_s", "cpu_s")}} if first else {}),
    }


def ratios(conditions: dict[str, Any], figure: str, arm: str, baseline: str) -> dict[str, float]:
    return {c: round(v[arm][figure] / v[baseline][figure], 3) for c, v in conditions.items()}


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
            logs = os.path.join(root, condition)  # a folder per condition: a forker per condition
            try:
                with load():
                    for index in range(args.repeats + 1):  # the first forker start is reported apart
                        for arm in ARMS:
                            if arm != "forker" and index == args.repeats:
                                continue
                            starts[arm].append(start_once(model, logs, arm, index))
                            print(f"[server_start] {condition} {arm} {index}: {starts[arm][-1]}", flush=True)
            finally:
                forker = stop_forkers()
            conditions[condition] = {arm: summary(starts[arm]) for arm in ARMS} | forker
    answers = {a for c in conditions.values() for arm in ARMS for a in c[arm]["answers"]}
    result = {
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()},
        "repeats": args.repeats,
        "conditions": conditions,
        "healthy_s_ratio_fork_over_spawn": ratios(conditions, "healthy_s_median", "fork", "spawn"),
        "group_pss_ratio_fork_over_spawn": ratios(conditions, "group_pss_mib_median", "fork", "spawn"),
        "healthy_s_ratio_forker_over_fork": ratios(conditions, "healthy_s_median", "forker", "fork"),
        "cpu_s_ratio_forker_over_fork": ratios(conditions, "cpu_s_median", "forker", "fork"),
        "group_pss_ratio_forker_over_fork": ratios(conditions, "group_pss_mib_median", "forker", "fork"),
        "same_answer_in_every_start": len(answers) == 1,
        "not_covered": NOT_COVERED,
    }
    write_result(args.out, result, ("conditions", "not_covered"))


if __name__ == "__main__":
    main()
