"""Numerical parity of the Megatron-Core training pool (fp32, gloo on a CPU machine, real Ray workers).

    python benchmarks/train_parity.py --out benchmarks/results/train_parity.json

Builds a tiny random Llama model, starts a local Ray cluster with logical GPUs and measures:
  logits_max_abs_diff_vs_hf   max |Megatron logits - HF transformers logits| on the same tokens, over the
                              TP1 and TP2 pools (target < 1e-3)
  tp2_vs_tp1_loss_abs_diff    max |loss(TP2) - loss(TP1)| over --steps GRPO steps on the same off-policy
                              data (rollout log-probs are not the model's, so the loss depends on the
                              weights and every step's update) (target < 1e-5)
  resume_next_loss_abs_diff   TP1: step 1, save, step 2; load, step 2 again: |difference| (target < 1e-6)
Also written: grad-norm differences, the TP2 -> TP1 resharded resume difference, targets, target_met.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGETS = {"logits_max_abs_diff_vs_hf": 1e-3, "tp2_vs_tp1_loss_abs_diff": 1e-5, "resume_next_loss_abs_diff": 1e-6}
PARITY_IDS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]


def offpolicy_samples(seed: int, n: int = 8, vocab: int = 200) -> list[Any]:
    """Random prompts/responses with rollout log-probs that are not the model's and random advantages."""
    from libra.training.spec import TrainSample

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        response = [rng.randrange(4, vocab) for _ in range(rng.randrange(4, 17))]
        out.append(
            TrainSample(
                prompt_ids=[rng.randrange(4, vocab) for _ in range(rng.randrange(4, 17))],
                response_ids=response,
                rollout_logprobs=[rng.uniform(-7.0, -4.0) for _ in response],
                advantage=rng.uniform(-1.0, 1.0),
                policy_version=0,
                reward=0.0,
            )
        )
    return out


def start_ray(num_gpus: int, tmp: str) -> Any:
    from libra.cluster.ray_runtime import RayRuntime

    return RayRuntime.start(num_gpus=num_gpus, num_cpus=2 * num_gpus, tmp_dir=os.path.join(tmp, "ray"))


def hf_logits(model_dir: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(PARITY_IDS)).logits.numpy()


def run(model_dir: str, steps: int, tmp: str) -> dict[str, Any]:
    import numpy as np

    from libra.config.mapping import cpu_config, training_pool_spec
    from libra.training.pool import TrainingPool

    expected = hf_logits(model_dir)
    runtime = start_ray(4, tmp)
    results: dict[str, Any] = {}
    try:
        per_layout: dict[str, dict[str, Any]] = {}
        for name, (gpus, tp) in {"tp2": (2, 2), "tp1": (1, 1)}.items():
            cfg = cpu_config(model_dir, train_tp_size=tp, train_micro_batch_size=2, recompute_logprobs=False,
                             optimizer={"lr": 1e-3, "weight_decay": 0.01})
            spec = training_pool_spec(cfg, num_gpus=gpus)
            pool = TrainingPool(runtime, spec, name=f"parity-{name}")
            try:
                pool.start()
                logits = np.array(pool.forward_logits(PARITY_IDS))
                metrics = []
                ckpt = os.path.join(tmp, f"ckpt-{name}")
                for step in range(1, steps + 1):
                    metrics.append(pool.train_step(offpolicy_samples(step), step))
                    if step == 1:
                        pool.save_checkpoint(ckpt, 1)
                entry: dict[str, Any] = {
                    "logits_diff": float(np.abs(logits - expected).max()),
                    "losses": [m["loss"] for m in metrics],
                    "grad_norms": [m["grad_norm"] for m in metrics],
                }
                if name == "tp1":
                    pool.load_checkpoint(ckpt)
                    entry["resumed_step2"] = pool.train_step(offpolicy_samples(2), 2)
                    pool.load_checkpoint(os.path.join(tmp, "ckpt-tp2"))
                    entry["resharded_step2"] = pool.train_step(offpolicy_samples(2), 2)
                per_layout[name] = entry
            finally:
                pool.shutdown()
    finally:
        runtime.shutdown()
    tp1, tp2 = per_layout["tp1"], per_layout["tp2"]
    results["logits_max_abs_diff_vs_hf"] = max(tp1["logits_diff"], tp2["logits_diff"])
    results["tp2_vs_tp1_loss_abs_diff"] = max(abs(a - b) for a, b in zip(tp1["losses"], tp2["losses"], strict=True))
    results["resume_next_loss_abs_diff"] = abs(tp1["resumed_step2"]["loss"] - tp1["losses"][1])
    results["tp2_vs_tp1_grad_norm_rel_diff"] = max(
        abs(a - b) / a for a, b in zip(tp1["grad_norms"], tp2["grad_norms"], strict=True)
    )
    results["tp2_checkpoint_at_tp1_next_loss_abs_diff"] = abs(tp1["resharded_step2"]["loss"] - tp2["losses"][1])
    results["losses_tp1"] = tp1["losses"]
    results["losses_tp2"] = tp2["losses"]
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per layout (>= 2)")
    parser.add_argument("--model", default="", help="HF model directory (default: build a tiny Llama)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the resume check replays step 2)")
    tmp = tempfile.mkdtemp(prefix="libra-train-parity-")
    t0 = time.perf_counter()
    try:
        model_dir = args.model
        if not model_dir:
            from libra.config.mapping import tiny_model_spec
            from libra.config.sections import TinyModelConfig
            from libra.models.tiny import build_tiny_model

            shape = TinyModelConfig(arch="llama", hidden_size=64, intermediate_size=128, max_position_embeddings=512,
                                    init_std=0.2)
            model_dir = build_tiny_model(os.path.join(tmp, "model"), tiny_model_spec(shape))
        results = run(model_dir, args.steps, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["targets"] = TARGETS
    results["target_met"] = all(results[k] < v for k, v in TARGETS.items())
    results["dtype"] = "fp32"
    results["model"] = args.model or "tiny llama (hidden 64, 2 layers, vocab 219, init_std 0.2)"
    results["machine"] = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in (*TARGETS, "target_met")}, indent=2))
    return 0 if results["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
