"""megatron_recompute_granularity really recomputes in a training worker: with `full` every transformer layer
runs its forward a second time during backward, with `selective` the core attention does, with `none` nothing
runs twice; and the step's loss and gradient norm are the same in all three (recomputation is exact).

Each granularity runs one real Megatron-Core worker (world size 1, gloo) in a child process, so the process
group and the CPU compatibility layer never touch the test runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
from training_cases import offpolicy_samples, pool_spec
from libra.training.worker import TrainingWorker, free_port

spec = pool_spec(sys.argv[1], 1, config={"megatron_recompute_granularity": sys.argv[2]}, micro_batch_size=2,
                 recompute_micro_batch_size=2, recompute_logprobs=False)
worker = TrainingWorker(spec, 0, 1)
worker.setup("127.0.0.1", free_port("127.0.0.1"))
layer = worker.chunks[0].module.decoder.layers[0]
calls = {"layer": 0, "core_attention": 0}
def counter(name):
    def hook(module, args, output):
        calls[name] += 1
    return hook
layer.register_forward_hook(counter("layer"))
layer.self_attention.core_attention.register_forward_hook(counter("core_attention"))
config = worker.chunks[0].module.config
metrics = worker.train_step(offpolicy_samples(1, n=4), 1)
print(json.dumps({"calls": calls, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                  "config": [config.recompute_granularity, config.recompute_method, config.recompute_num_layers]}))
worker.shutdown()
"""


def run_worker(model: str, granularity: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, model, granularity, str(HERE)], capture_output=True,
                          text=True, timeout=600, env=env, cwd=str(REPO))
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tiny_model_dir: str) -> dict[str, dict]:
    return {granularity: run_worker(tiny_model_dir, granularity) for granularity in ("none", "selective", "full")}


def test_full_recomputation_reruns_every_layer(runs: dict[str, dict]) -> None:
    micro_batches = 2  # 4 samples, micro batch 2
    assert runs["none"]["calls"] == {"layer": micro_batches, "core_attention": micro_batches}
    assert runs["full"]["config"] == ["full", "uniform", 1]
    assert runs["full"]["calls"]["layer"] == 2 * micro_batches
    assert runs["selective"]["config"] == ["selective", None, None]
    assert runs["selective"]["calls"] == {"layer": micro_batches, "core_attention": 2 * micro_batches}


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_recomputation_leaves_the_step_unchanged(runs: dict[str, dict], granularity: str) -> None:
    assert runs[granularity]["loss"] == pytest.approx(runs["none"]["loss"], rel=1e-6, abs=1e-7)
    assert runs[granularity]["grad_norm"] == pytest.approx(runs["none"]["grad_norm"], rel=1e-5)
