"""Weight reload and rollout throughput on real vLLM servers: in-place vs restart, parallel vs serial, and the
pool's tokens/s with one vs two instances, for a tiny model and for a model of about 113M parameters.

    python benchmarks/weight_reload.py --out benchmarks/results/weight_reload.json

Starts a local Ray cluster with logical GPUs and runs two cases, each with two random models of the same
shape (different seeds) built locally with `libra.models.tiny` (no model hub):
  tiny (top-level figures): Llama, hidden 128, 4 layers; a managed RolloutPool of one instance, generation
      throughput, a second instance added, throughput again, then weights published alternately:
        - in-place, parallel (`--repeats` times)
        - in-place, serial (node by node; `--repeats` times)
        - restart, parallel (`--restarts` times: each replaces every server process)
  large_model: Llama, hidden 1024, 10 layers, 16 heads / 4 KV heads (about 113M parameters, float32
      safetensors of about 450 MB); one instance, `--repeats` in-place and `--restarts` restart refreshes.
Every refresh's ACK batch is validated by the pool (a bad ACK raises); the counts are written out. Every
figure of a refresh kind is the median over its repeats; the single values are kept beside it.

Figures written (top level: the tiny case; `large_model`: the same names for the ~113M model):
  inplace_total_s / restart_total_s      median wall time of one refresh of the whole pool (parallel)
  inplace_runs_s / restart_runs_s        every refresh of that kind, in order
  parallel_total_s / serial_total_s      median in-place refresh time with each strategy
  inplace_speedup_vs_restart, target_met (in-place at least 5x faster than restart)
  weights_bytes                          size of the model's safetensors files (what one refresh reads)
  inplace_bytes_per_s                    weights_bytes / median in-place refresh of one instance (the whole
                                         reload request: pause, read + sha256 check + load, resume)
  inplace_load_bytes_per_s               weights_bytes / median server-measured model load of the in-place path
  acks_expected, acks_validated          summed over every refresh of the case
  slowest_instance                       slowest instance of the last restart refresh
  phases                                 per method/strategy: max and mean of lock_wait_s, process_stop_s,
                                         model_load_s and total_s over the ACKs of every repeat
  throughput (tiny case)                 tokens/s of the pool with one and with two instances (median of
                                         --runs batches; on a 2-core host the two servers and their API
                                         processes share the same two cores, so two cannot beat one there)
  not_covered                            what these figures do not measure
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from libra.cluster.ray_runtime import RayRuntime  # noqa: E402
from libra.metering.spec import OFF as METERING_OFF  # noqa: E402
from libra.models.tiny import TinyModelSpec, build_tiny_model  # noqa: E402
from libra.rollout.pool import RolloutPool, stop_registered_servers  # noqa: E402
from libra.rollout.reload import ReloadReport  # noqa: E402
from libra.rollout.spec import RolloutPoolSpec  # noqa: E402
from libra.rollout.weights_checksum import checksum_hf_weights  # noqa: E402

TARGET_SPEEDUP = 5.0
KV_CACHE_BYTES = 64 * 2**20  # sized explicitly: vLLM-CPU's default takes gigabytes per server
NOT_COVERED = [
    "vLLM-CPU servers (float32, eager mode) on a shared 2-core machine: GPU servers load weights into HBM "
    "over PCIe and start CUDA graphs, so both restart and in-place times differ on a cluster",
    "the weights travel from a local safetensors folder (page cache, loopback HTTP for the reload request): "
    "no network filesystem, no cross-node transfer",
    "no NCCL broadcast from the training pool (rollout_weight_sync_mode nccl is not implemented); the in-place "
    "path re-reads the exported checkpoint, and its time includes the server's sha256 check of every tensor",
    "rollout TP 1 only; the export of the checkpoint by the training pool is not part of a refresh here",
]


@dataclass(frozen=True)
class Case:
    """One model shape and how many instances serve it."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    instances: int
    throughput: bool
    serial: bool


def note(message: str) -> None:
    print(f"[weight_reload] {message}", file=sys.stderr, flush=True)


def model_spec(case: Case, seed: int) -> TinyModelSpec:
    return TinyModelSpec(
        arch="llama", hidden_size=case.hidden, num_layers=case.layers, num_heads=case.heads,
        num_kv_heads=case.kv_heads, intermediate_size=case.intermediate, max_position_embeddings=512,
        init_std=0.2, seed=seed, vocab_size=256,
    )  # fmt: skip


def build_models(root: str, case: Case) -> list[tuple[str, str]]:
    models = []
    for seed in (0, 1):
        path = build_tiny_model(os.path.join(root, f"{case.name}-{seed}"), model_spec(case, seed))
        models.append((path, checksum_hf_weights(path)))
    return models


def safetensors_facts(path: str) -> tuple[int, int]:
    """(bytes, parameters) of the safetensors files in `path`."""
    from safetensors import safe_open

    size = params = 0
    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        file = os.path.join(path, name)
        size += os.path.getsize(file)
        with safe_open(file, framework="numpy") as fh:
            for key in fh.keys():
                count = 1
                for dim in fh.get_slice(key).get_shape():
                    count *= int(dim)
                params += count
    return size, params


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


def run_case(runtime: Any, work: str, case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """Start the case's pool, measure its refreshes (and throughput), stop it; returns its figures."""
    run_dir = os.path.join(work, f"run-{case.name}")
    models = build_models(os.path.join(work, "models"), case)
    weights_bytes, params = safetensors_facts(models[0][0])
    note(f"{case.name}: {params / 1e6:.1f}M parameters, {weights_bytes / 2**20:.0f} MiB of safetensors")
    spec = RolloutPoolSpec(
        model_path=models[0][0], num_instances=1, tp_size=1, max_model_len=512, kv_cache_bytes=KV_CACHE_BYTES,
        port_base=0, enforce_eager=True, manage_processes=True, endpoints=(), reload_method="inplace",
        reload_strategy="parallel", max_concurrent_requests=64, seed=0, gpu_memory_utilization=0.5,
        metering=METERING_OFF, run_dir=run_dir,
    )  # fmt: skip
    pool = RolloutPool(runtime, spec)
    reports: dict[str, list[ReloadReport]] = {"inplace-parallel": [], "restart-parallel": []}
    if case.serial:
        reports["inplace-serial"] = []
    out: dict[str, Any] = {}
    try:
        note(f"{case.name}: starting one vLLM instance")
        started = time.perf_counter()
        pool.start()
        out["startup"] = {"first_instance_s": round(time.perf_counter() - started, 1)}
        if case.throughput:
            one = throughput(pool, args.groups, args.samples, args.tokens, args.runs)
            note(f"{case.name}: one instance: {one['tokens_per_s']} tokens/s")
        for _ in range(case.instances - 1):
            started = time.perf_counter()
            pool.add_instance()
            out["startup"]["add_instance_s"] = round(time.perf_counter() - started, 1)
        if case.throughput:
            two = throughput(pool, args.groups, args.samples, args.tokens, args.runs)
            note(f"{case.name}: {case.instances} instances: {two['tokens_per_s']} tokens/s")
        version = 0
        for key in [k for k in reports if k.startswith("inplace")]:
            for _ in range(args.repeats):
                version += 1
                path, checksum = models[version % 2]
                reports[key].append(
                    pool.publish_weights(
                        version, path, checksum, method="inplace", strategy=key.split("-")[1]
                    )
                )
        note(f"{case.name}: {version} in-place refreshes done; {args.restarts} restarts")
        for _ in range(args.restarts):
            version += 1
            path, checksum = models[version % 2]
            reports["restart-parallel"].append(
                pool.publish_weights(version, path, checksum, method="restart", strategy="parallel")
            )
        after_restart = pool.generate_batch([[5, 6, 7]] * 4, n=1, max_new_tokens=8, temperature=0.0)
        served_after_restart = sorted({c.instance_id for g in after_restart for c in g})
    finally:
        pool.shutdown()
        stop_registered_servers(run_dir)

    def totals(key: str) -> list[float]:
        return [round(r.total_s, 4) for r in reports[key]]

    def median_total(key: str) -> float:
        return round(statistics.median(totals(key)), 4)

    all_reports = [r for rs in reports.values() for r in rs]
    inplace_total = median_total("inplace-parallel")
    restart_total = median_total("restart-parallel")
    speedup = restart_total / inplace_total if inplace_total > 0 else float("inf")
    per_instance_inplace = statistics.median(a.total_s for r in reports["inplace-parallel"] for a in r.acks)
    inplace_load = statistics.median(a.model_load_s for r in reports["inplace-parallel"] for a in r.acks)
    result: dict[str, Any] = {
        "restart_total_s": restart_total,
        "inplace_total_s": inplace_total,
        "restart_runs_s": totals("restart-parallel"),
        "inplace_runs_s": totals("inplace-parallel"),
        "parallel_total_s": inplace_total,
    }
    if case.serial:
        result["serial_total_s"] = median_total("inplace-serial")
    result.update({
        "inplace_speedup_vs_restart": round(speedup, 1),
        "target_speedup": TARGET_SPEEDUP,
        "target_met": speedup >= TARGET_SPEEDUP,
        "weights_bytes": weights_bytes,
        "parameters": params,
        "inplace_instance_total_s": round(per_instance_inplace, 4),
        "inplace_bytes_per_s": round(weights_bytes / per_instance_inplace),
        "inplace_model_load_s": round(inplace_load, 4),
        "inplace_load_bytes_per_s": round(weights_bytes / inplace_load) if inplace_load > 0 else None,
        "acks_expected": sum(r.acks_expected for r in all_reports),
        "acks_validated": sum(r.acks_validated for r in all_reports),
        "slowest_instance": reports["restart-parallel"][-1].slowest_instance,
        "phases": {key: phase_stats(rs) for key, rs in reports.items()},
    })  # fmt: skip
    if case.throughput:
        result["throughput"] = {
            "one_instance": one,
            "two_instances": two,
            "scaling": round(two["tokens_per_s"] / one["tokens_per_s"], 2),
        }
    result["instances_serving_after_restart"] = served_after_restart
    result["startup"] = out["startup"]
    result["refreshes"] = [refresh_summary(r) for r in all_reports]
    result["model"] = {
        "arch": "llama", "hidden": case.hidden, "layers": case.layers, "heads": case.heads,
        "kv_heads": case.kv_heads, "intermediate": case.intermediate, "head_dim": case.hidden // case.heads,
        "dtype": "float32", "vocab": model_spec(case, 0).vocab_size,
    }  # fmt: skip
    result["instances"] = case.instances
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument(
        "--repeats", type=int, default=5, help="in-place refreshes per strategy (median reported)"
    )
    parser.add_argument(
        "--restarts", type=int, default=3, help="restart refreshes per case (median reported)"
    )
    parser.add_argument(
        "--hidden", type=int, default=128, help="hidden size of the tiny model (multiple of 32)"
    )
    parser.add_argument("--layers", type=int, default=4, help="layers of the tiny model")
    parser.add_argument("--skip-large", action="store_true", help="run the tiny case only")
    parser.add_argument("--groups", type=int, default=32, help="prompts per throughput batch")
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per completion")
    parser.add_argument(
        "--runs", type=int, default=3, help="throughput batches per pool size (median reported)"
    )
    args = parser.parse_args()
    if args.hidden % 32:
        parser.error(f"--hidden={args.hidden}: must be a multiple of 32 (vLLM-CPU head size 32)")
    if args.repeats < 5 or args.restarts < 3:
        parser.error("--repeats must be >= 5 and --restarts >= 3 (the figures are medians)")

    tiny = Case(
        "tiny",
        args.hidden,
        args.layers,
        args.hidden // 32,
        1,
        2 * args.hidden,
        instances=2,
        throughput=True,
        serial=True,
    )
    large = Case("large_model", 1024, 10, 16, 4, 2816, instances=1, throughput=False, serial=False)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    work = tempfile.mkdtemp(prefix="libra-bench-reload-")
    runtime = RayRuntime.start(
        num_gpus=2, num_cpus=4, tmp_dir=os.path.join(work, "ray"), namespace="libra-bench"
    )
    load_start = os.getloadavg()[0]
    try:
        result = run_case(runtime, work, tiny, args)
        if not args.skip_large:
            shutil.rmtree(os.path.join(work, "models"), ignore_errors=True)
            result["large_model"] = run_case(runtime, work, large, args)
    finally:
        runtime.shutdown()
    import vllm

    result["not_covered"] = NOT_COVERED
    result["setup"] = {
        "workload": {
            "groups": args.groups,
            "samples": args.samples,
            "new_tokens": args.tokens,
            "runs": args.runs,
        },
        "repeats": args.repeats,
        "restarts": args.restarts,
        "kv_cache_bytes": KV_CACHE_BYTES,
        "vllm": vllm.__version__,
    }
    result["machine"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_avg_1m_at_start": round(load_start, 2),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
    }
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
    headline = (
        "restart_total_s",
        "inplace_total_s",
        "inplace_speedup_vs_restart",
        "inplace_bytes_per_s",
        "acks_expected",
        "acks_validated",
    )
    summary = {k: result[k] for k in headline}
    if "large_model" in result:
        summary["large_model"] = {
            k: result["large_model"][k] for k in ("parameters", "weights_bytes") + headline
        }
    print(json.dumps(summary, indent=2))
    cases = [result] + ([result["large_model"]] if "large_model" in result else [])
    ok = all(c["target_met"] and c["acks_validated"] == c["acks_expected"] for c in cases)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
