"""Weight reload and rollout throughput on real vLLM servers: in-place vs restart, parallel vs serial, and the
pool's tokens/s with one vs two instances.

    python benchmarks/weight_reload.py --out benchmarks/results/weight_reload.json

Builds two tiny Llama models of the same shape (different seeds), starts a local Ray cluster with logical
GPUs and a managed RolloutPool of one instance, measures generation throughput, adds a second instance,
measures again, then publishes weights alternately:
  - in-place, parallel (`--repeats` times; medians reported)
  - in-place, serial (node by node; `--repeats` times)
  - restart, parallel (once: it replaces every server process)
Every refresh's ACK batch is validated by the pool (a bad ACK raises); the counts are written out.

Figures written:
  inplace_total_s / restart_total_s      median wall time of one refresh of the whole pool (parallel)
  parallel_total_s / serial_total_s      median in-place refresh time with each strategy
  inplace_speedup_vs_restart, target_met (in-place at least 5x faster than restart)
  acks_expected, acks_validated          summed over every refresh of the run
  slowest_instance                       slowest instance of the restart refresh (per refresh: `refreshes`)
  phases                                 per method/strategy: max and mean of lock_wait_s, process_stop_s,
                                         model_load_s and total_s over the ACKs of every repeat
  throughput                             tokens/s of the pool with one and with two instances (median of
                                         --runs batches; on a 2-core host the two servers and their API
                                         processes share the same two cores, so two cannot beat one there)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from libra.cluster.ray_runtime import RayRuntime  # noqa: E402
from libra.models.tiny import TinyModelSpec, build_tiny_model  # noqa: E402
from libra.rollout.pool import RolloutPool, stop_registered_servers  # noqa: E402
from libra.rollout.reload import ReloadReport  # noqa: E402
from libra.rollout.spec import RolloutPoolSpec  # noqa: E402
from libra.rollout.weights_checksum import checksum_hf_weights  # noqa: E402

TARGET_SPEEDUP = 5.0


def note(message: str) -> None:
    print(f"[weight_reload] {message}", file=sys.stderr, flush=True)


def build_models(root: str, hidden: int, layers: int) -> list[tuple[str, str]]:
    models = []
    for seed in (0, 1):
        spec = TinyModelSpec(
            arch="llama", hidden_size=hidden, num_layers=layers, num_heads=hidden // 32, num_kv_heads=1,
            intermediate_size=2 * hidden, init_std=0.2, seed=seed,
        )  # fmt: skip
        path = build_tiny_model(os.path.join(root, f"model-{seed}"), spec)
        models.append((path, checksum_hf_weights(path)))
    return models


def throughput(pool: RolloutPool, groups: int, n: int, tokens: int, runs: int) -> dict[str, Any]:
    """Tokens/s of `runs` batches of `groups` prompts x `n` samples (wall clock); the median run is reported."""
    prompts = [[5 + (i % 50), 6, 7, 8, 9 + (i % 7)] for i in range(groups)]
    pool.generate_batch(prompts[:4], n=1, max_new_tokens=4, temperature=1.0)  # warm every instance
    rates, used = [], set()
    for run in range(runs):
        start = time.perf_counter()
        result = pool.generate_batch(prompts, n=n, max_new_tokens=tokens, temperature=1.0, seed=run)
        wall = time.perf_counter() - start
        rates.append(sum(len(c.token_ids) for g in result for c in g) / wall)
        used |= {c.instance_id for g in result for c in g}
    return {
        "tokens_per_s": round(statistics.median(rates), 1),
        "runs_tokens_per_s": [round(r, 1) for r in rates],
        "instances_used": len(used),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def refresh_summary(report: ReloadReport) -> dict[str, Any]:
    return {
        "weight_version": report.weight_version,
        "method": report.method,
        "strategy": report.strategy,
        "total_s": round(report.total_s, 4),
        "slowest_instance": report.slowest_instance,
        "slowest_total_s": round(report.slowest_total_s, 4),
        "acks_expected": report.acks_expected,
        "acks_validated": report.acks_validated,
        "order": [list(w) for w in report.order],
        "acks": [
            {
                k: (round(v, 4) if isinstance(v, float) else v)
                for k, v in a.to_dict().items()
                if k != "worker_checksums"
            }
            for a in report.acks
        ],
    }


def phase_stats(reports: list[ReloadReport]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in ("lock_wait_s", "process_stop_s", "model_load_s", "total_s"):
        values = [float(getattr(a, name)) for r in reports for a in r.acks]
        out[name] = {"max": round(max(values), 4), "mean": round(statistics.fmean(values), 4)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--repeats", type=int, default=5, help="in-place refreshes per strategy")
    parser.add_argument(
        "--hidden", type=int, default=128, help="hidden size of the tiny model (multiple of 32)"
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--groups", type=int, default=32, help="prompts per throughput batch")
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per completion")
    parser.add_argument(
        "--runs", type=int, default=3, help="throughput batches per pool size (median reported)"
    )
    args = parser.parse_args()
    if args.hidden % 32:
        parser.error(f"--hidden={args.hidden}: must be a multiple of 32 (vLLM-CPU head size 32)")

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    work = tempfile.mkdtemp(prefix="libra-bench-reload-")
    run_dir = os.path.join(work, "run")
    runtime = RayRuntime.start(
        num_gpus=2, num_cpus=4, tmp_dir=os.path.join(work, "ray"), namespace="libra-bench"
    )
    pool: RolloutPool | None = None
    load_start = os.getloadavg()[0]
    try:
        models = build_models(os.path.join(work, "models"), args.hidden, args.layers)
        spec = RolloutPoolSpec(
            model_path=models[0][0], num_instances=1, max_model_len=512, kv_cache_bytes=64 * 2**20,
            run_dir=run_dir, max_concurrent_requests=64,
        )  # fmt: skip
        pool = RolloutPool(runtime, spec)
        note("starting one vLLM instance")
        started = time.perf_counter()
        pool.start()
        first_start_s = time.perf_counter() - started
        one = throughput(pool, args.groups, args.samples, args.tokens, args.runs)
        note(f"one instance: {one['tokens_per_s']} tokens/s; adding a second instance")
        started = time.perf_counter()
        pool.add_instance()
        add_instance_s = time.perf_counter() - started
        two = throughput(pool, args.groups, args.samples, args.tokens, args.runs)

        reports: dict[str, list[ReloadReport]] = {
            "inplace-parallel": [],
            "inplace-serial": [],
            "restart-parallel": [],
        }
        version = 0
        for strategy in ("parallel", "serial"):
            for _ in range(args.repeats):
                version += 1
                path, checksum = models[version % 2]
                reports[f"inplace-{strategy}"].append(
                    pool.publish_weights(version, path, checksum, method="inplace", strategy=strategy)
                )
        note(f"two instances: {two['tokens_per_s']} tokens/s; {version} in-place refreshes done; restarting")
        version += 1
        path, checksum = models[version % 2]
        restart = pool.publish_weights(version, path, checksum, method="restart", strategy="parallel")
        reports["restart-parallel"].append(restart)
        after_restart = pool.generate_batch([[5, 6, 7]] * 4, n=1, max_new_tokens=8, temperature=0.0)
        served_after_restart = sorted({c.instance_id for g in after_restart for c in g})
    finally:
        if pool is not None:
            pool.shutdown()
        stop_registered_servers(run_dir)
        runtime.shutdown()

    def median_total(key: str) -> float:
        return round(statistics.median(r.total_s for r in reports[key]), 4)

    all_reports = [r for rs in reports.values() for r in rs]
    inplace_total = median_total("inplace-parallel")
    restart_total = median_total("restart-parallel")
    speedup = restart_total / inplace_total if inplace_total > 0 else float("inf")
    import vllm

    result: dict[str, Any] = {
        "restart_total_s": restart_total,
        "inplace_total_s": inplace_total,
        "parallel_total_s": inplace_total,
        "serial_total_s": median_total("inplace-serial"),
        "inplace_speedup_vs_restart": round(speedup, 1),
        "target_speedup": TARGET_SPEEDUP,
        "target_met": speedup >= TARGET_SPEEDUP,
        "acks_expected": sum(r.acks_expected for r in all_reports),
        "acks_validated": sum(r.acks_validated for r in all_reports),
        "slowest_instance": restart.slowest_instance,
        "phases": {key: phase_stats(rs) for key, rs in reports.items()},
        "throughput": {
            "one_instance": one,
            "two_instances": two,
            "scaling": round(two["tokens_per_s"] / one["tokens_per_s"], 2),
            "instances_serving_after_restart": served_after_restart,
        },
        "startup": {"first_instance_s": round(first_start_s, 1), "add_instance_s": round(add_instance_s, 1)},
        "refreshes": [refresh_summary(r) for r in all_reports],
        "setup": {
            "model": {"arch": "llama", "hidden": args.hidden, "layers": args.layers, "head_dim": 32},
            "workload": {
                "groups": args.groups,
                "samples": args.samples,
                "new_tokens": args.tokens,
                "runs": args.runs,
            },
            "repeats": args.repeats,
            "instances": 2,
            "vllm": vllm.__version__,
        },
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_1m_at_start": round(load_start, 2),
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        },
    }
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
    print(json.dumps({k: result[k] for k in list(result)[:11]}, indent=2))
    return 0 if result["target_met"] and result["acks_validated"] == result["acks_expected"] else 1


if __name__ == "__main__":
    sys.exit(main())
