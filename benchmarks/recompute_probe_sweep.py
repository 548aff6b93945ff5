"""The planner's log-prob recomputation estimate against real Megatron-Core probes, over model and sequence
shapes (the check `memory_budget_dry_run_enabled` runs once at launch, here on a grid).

For each tiny Llama-architecture model (hidden size, query heads, KV heads, MLP width) and tensor-parallel
size (1, and 2 where the KV heads split) a training pool is started on Ray and `TrainingPool.recompute_probe`
runs one forward-only log-prob micro batch per (sequence length, micro batch) point; the peak above the
resident model state (the largest over the ranks) is compared with the planner's transient for the same
shape and layout, built from `configs/dev.yaml` with the model swapped in (fp32,
Megatron-Core's unfused attention: what a launch on this CPU machine estimates).

    python benchmarks/recompute_probe_sweep.py --out benchmarks/results/recompute_probe_sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODELS = ((64, 2, 1, 128), (128, 4, 2, 256), (128, 2, 2, 256), (256, 4, 2, 256), (128, 4, 4, 512))
SEQ_LENS = (64, 128, 256)
MICRO_BATCHES = (2, 4)


def estimate(model_dir: str, micro_batch: int, seq_len: int, tp: int = 1) -> int:
    from libra.config.loader import load
    from libra.planning import planner_inputs, recompute_estimate, transient_bytes
    from planner.layout import TrainLayout

    cfg = load(str(REPO / "configs" / "dev.yaml"), [f"model_path={model_dir}", "build_tiny_model.enabled=false"])
    return transient_bytes(recompute_estimate(planner_inputs(cfg), TrainLayout(tp=tp), 1, micro_batch, seq_len))


def sweep(tmp: str) -> list[dict[str, Any]]:
    from libra.cluster.ray_runtime import RayRuntime
    from libra.config.mapping import cpu_config, tiny_model_spec, training_pool_spec
    from libra.config.sections import TinyModelConfig
    from libra.models.tiny import build_tiny_model
    from libra.training.pool import TrainingPool

    runtime = RayRuntime.start(num_gpus=2, num_cpus=2, tmp_dir=os.path.join(tmp, "ray"), namespace="probe-sweep")
    points: list[dict[str, Any]] = []
    try:
        for hidden, heads, kv_heads, ffn in MODELS:
            model_dir = build_tiny_model(os.path.join(tmp, f"model-{hidden}-{heads}-{kv_heads}-{ffn}"), tiny_model_spec(
                TinyModelConfig(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=ffn,
                                max_position_embeddings=512)))
            for tp in (1, 2) if kv_heads % 2 == 0 else (1,):
                pool = TrainingPool(runtime, training_pool_spec(cpu_config(model_dir, train_tp_size=tp), num_gpus=tp),
                                    name="probe-sweep")
                pool.start()
                try:
                    for seq_len in SEQ_LENS:
                        for micro_batch in MICRO_BATCHES:
                            measured = int(pool.recompute_probe(seq_len, micro_batch)["added_peak_bytes"])
                            estimated = estimate(model_dir, micro_batch, seq_len, tp)
                            point = {"hidden": hidden, "heads": heads, "kv_heads": kv_heads, "ffn": ffn, "tp": tp,
                                     "seq_len": seq_len, "micro_batch": micro_batch, "measured_bytes": measured,
                                     "estimated_bytes": estimated,
                                     "rel_error": round((estimated - measured) / measured, 4)}
                            points.append(point)
                            print(json.dumps(point), flush=True)
                finally:
                    pool.shutdown()
    finally:
        runtime.shutdown()
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON result file")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="libra-probe-sweep-") as tmp:
        points = sweep(tmp)
    errors = [p["rel_error"] for p in points]
    result = {
        "points": points,
        "worst_rel_error": max(errors, key=abs),
        "mean_abs_rel_error": round(sum(abs(e) for e in errors) / len(errors), 4),
        "within_15_percent": sum(abs(e) <= 0.15 for e in errors),
        "count": len(points),
        "memory_method": "torch MemTracker (live tensor storage, CPU), fp32",
        "wall_s": round(time.monotonic() - started, 1),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("worst_rel_error", "mean_abs_rel_error", "within_15_percent", "count")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
