"""Training-step time per layout and the peak memory of log-prob recomputation (real Megatron-Core on Ray).

    python benchmarks/train_step.py --out benchmarks/results/train_step.json

For each layout (TP1, DP2, TP2, PP2 by default) a pool trains --steps GRPO steps (recomputation on) on
--samples samples; the first step is warm-up, the rest are timed (median wall time of a pool step, and the
workers' own recompute / forward-backward+optimizer times).

Recomputation memory: on the TP1 and TP2 pools, one forward-only log-prob micro batch of --seq-len tokens is
measured for each --recompute-sizes value (`TrainingPool.recompute_probe`: CUDA allocator peak on a GPU,
torch's MemTracker of live tensor storage on a CPU). Written per point: peak_bytes, baseline_bytes (model
state live before), added_peak_bytes (what the micro batch adds) and logits_bytes = rows x seq x vocab/TP x 4,
with the model facts (hidden, layers, padded vocab, TP) the planner's memory model takes as inputs.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_parity import offpolicy_samples, start_ray  # noqa: E402

LAYOUTS = {"tp1": (1, 1, 1), "dp2": (2, 1, 1), "tp2": (2, 2, 1), "pp2": (2, 1, 2)}  # gpus, tp, pp


def measure(model_dir: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    from libra.config.mapping import cpu_config, training_pool_spec
    from libra.training.hf_arch import padded_vocab_size, read_training_model
    from libra.training.pool import TrainingPool

    arch = read_training_model(model_dir)
    runtime = start_ray(4, tmp)
    layouts: dict[str, Any] = {}
    recompute: list[dict[str, Any]] = []
    try:
        for name in args.layouts:
            gpus, tp, pp = LAYOUTS[name]
            cfg = cpu_config(model_dir, train_tp_size=tp, train_pp_size=pp, train_micro_batch_size=args.micro_batch_size,
                             recompute_micro_batch_size=args.micro_batch_size,
                             optimizer={"lr": 1e-4, "weight_decay": 0.01})
            spec = training_pool_spec(cfg, num_gpus=gpus)
            pool = TrainingPool(runtime, spec, name=f"bench-{name}")
            try:
                t0 = time.perf_counter()
                pool.start()
                start_s = time.perf_counter() - t0
                steps = [pool.train_step(offpolicy_samples(s, args.samples), s) for s in range(args.steps + 1)][1:]
                layouts[name] = {
                    "gpus": gpus, "tp": tp, "pp": pp, "dp": gpus // (tp * pp), "start_s": round(start_s, 2),
                    "step_s_median": statistics.median(m["time_step_s"] for m in steps),
                    "recompute_s_median": statistics.median(m["time_recompute_s"] for m in steps),
                    "train_s_median": statistics.median(m["time_train_s"] for m in steps),
                    "tokens_per_step": steps[0]["tokens"],
                }
                if name in ("tp1", "tp2"):
                    vocab = padded_vocab_size(arch.vocab_size, tp) // tp
                    for rows in args.recompute_sizes:
                        probe = pool.recompute_probe(args.seq_len, rows)
                        recompute.append({
                            "layout": name, "tp": tp, "recompute_micro_batch_size": rows, "seq_len": probe["seq_len"],
                            "peak_bytes": probe["peak_bytes"], "baseline_bytes": probe["baseline_bytes"],
                            "added_peak_bytes": probe["added_peak_bytes"],
                            "logits_bytes": rows * probe["seq_len"] * vocab * 4,
                        })  # fmt: skip
            finally:
                pool.shutdown()
    finally:
        runtime.shutdown()
    return {
        "layouts": layouts,
        "recompute_memory": recompute,
        "model": {
            "hidden_size": arch.hidden_size, "num_layers": arch.num_layers, "num_heads": arch.num_attention_heads,
            "num_kv_heads": arch.num_kv_heads, "ffn_hidden_size": arch.intermediate_size, "vocab_size": arch.vocab_size,
            "params_dtype": "fp32",
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=4, help="timed steps per layout (after one warm-up step)")
    parser.add_argument("--samples", type=int, default=8, help="samples per step")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128, help="tokens of the recomputation probe")
    parser.add_argument("--recompute-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="libra-train-step-")
    t0 = time.perf_counter()
    try:
        from libra.config.mapping import tiny_model_spec
        from libra.config.sections import TinyModelConfig
        from libra.models.tiny import build_tiny_model

        spec = tiny_model_spec(TinyModelConfig(
            arch="llama", hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2,
            intermediate_size=2 * args.hidden, max_position_embeddings=512, init_std=0.02,
        ))  # fmt: skip
        results = measure(build_tiny_model(os.path.join(tmp, "model"), spec), args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    results["memory_method"] = "cuda allocator peak" if _cuda() else "torch MemTracker (live tensor storage, CPU)"
    results["machine"] = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v["step_s_median"] for k, v in results["layouts"].items()}, indent=2))
    return 0


def _cuda() -> bool:
    from libra.device import cuda_available

    return cuda_available()


if __name__ == "__main__":
    sys.exit(main())
