"""Elastic hybrid parallelism (EHP) figures for the "ehp" key of `benchmarks/train_resize.py`.

    from train_resize_ehp import measure_ehp
    result["ehp"] = measure_ehp(runtime, model_dir)          # a RayRuntime with >= 2 x core_gpus + lent GPUs

or alone:  python benchmarks/train_resize_ehp.py --out benchmarks/results/train_resize_ehp.json

Two pools of the same spec start from the same weights: `fixed` steps alone, `core` steps with `lent` borrowed
GPUs (`EhpSession`, one replica per `core_gpus` GPUs). Step 1 is a warm-up of both alone; steps 2.. run the
same batch on both. Written: `step_s_without` / `step_s_with` (median wall time of a pool step, fixed vs
core+borrowed), `grad_max_abs_diff` (largest |difference| of any gradient element of any step, core+borrowed
vs fixed), `param_max_abs_diff` (the same for the parameters after the last step), `replicas`, `decouple`,
`attach_s`. On shared CPU cores the borrowed replicas cannot make a step faster (every logical GPU shares the
same cores): the speed-up is measured once logical GPUs are metered.
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


def measure_ehp(runtime: Any, model_dir: str, *, steps: int = 3, samples: int = 8, core_gpus: int = 1,
                lent: int = 2, decouple: bool = True) -> dict[str, Any]:
    """EHP step time and gradient parity (see the module docstring); needs 2 x core_gpus + lent free GPUs."""
    from libra.cluster.ehp_workers import LentGpu
    from libra.config.mapping import cpu_config, training_pool_spec
    from libra.training.ehp import EhpSession, EhpSettings, max_abs_diff, shard_state
    from libra.training.pool import TrainingPool

    cfg = cpu_config(model_dir, train_tp_size=core_gpus, train_micro_batch_size=1, recompute_micro_batch_size=2,
                     optimizer={"lr": 1e-3})
    spec = training_pool_spec(cfg, num_gpus=core_gpus)
    fixed = TrainingPool(runtime, spec, name="bench-ehp-fixed")
    core = TrainingPool(runtime, spec, name="bench-ehp-core")
    session = EhpSession(core, EhpSettings(decouple_communication_domains=decouple))
    without: list[float] = []
    with_ehp: list[float] = []
    grad_diff = 0.0
    try:
        fixed.start()
        core.start()
        batch = offpolicy_samples(1, samples)
        fixed.train_step(batch, 1)
        core.train_step(batch, 1)
        t0 = time.perf_counter()
        session.attach([LentGpu(gpu_id=f"lent-{i}") for i in range(lent)])
        attach_s = time.perf_counter() - t0
        for step in range(2, steps + 2):
            batch = offpolicy_samples(step, samples)
            without.append(fixed.train_step(batch, step)["time_step_s"])
            with_ehp.append(session.train_step(batch, step)["time_step_s"])
            grad_diff = max(grad_diff, max_abs_diff(shard_state(core), shard_state(fixed), "grad"))
        param_diff = max_abs_diff(shard_state(core), shard_state(fixed), "param")
        replicas = session.replicas
    finally:
        session.detach()
        core.shutdown()
        fixed.shutdown()
    return {
        "step_s_without": round(statistics.median(without), 4),
        "step_s_with": round(statistics.median(with_ehp), 4),
        "grad_max_abs_diff": grad_diff,
        "param_max_abs_diff": param_diff,
        "replicas": replicas,
        "decouple": decouple,
        "attach_s": round(attach_s, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--lent", type=int, default=2)
    parser.add_argument("--no-decouple", action="store_true")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="libra-bench-ehp-")
    try:
        from libra.config.mapping import tiny_model_spec
        from libra.config.sections import TinyModelConfig
        from libra.models.tiny import build_tiny_model

        model = build_tiny_model(os.path.join(tmp, "model"), tiny_model_spec(TinyModelConfig(
            arch="llama", hidden_size=64, intermediate_size=128, max_position_embeddings=512, init_std=0.2, seed=0)))
        runtime = start_ray(2 + args.lent, tmp)
        try:
            ehp = measure_ehp(runtime, model, steps=args.steps, samples=args.samples, lent=args.lent,
                              decouple=not args.no_decouple)
        finally:
            runtime.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"ehp": ehp, "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
