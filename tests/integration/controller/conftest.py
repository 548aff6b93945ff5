"""Fixtures of the controller integration tests: a small job configuration (tiny model, one rollout
instance, one training GPU) and helpers to run `libra launch` as a real subprocess in its own session and
to find every process it left behind."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]


# Test jobs' listening ports (rollout servers, the Prometheus exporter): below the training rendezvous ports
# (20000-32767) and the kernel's ephemeral range, where an outgoing connection's local port could take one between
# the pick and the job's bind (a job's exporter failed to start so, "Address already in use").
TEST_LISTEN_PORTS = range(10000, 20000)


def free_port() -> int:
    """A port free now for one listener of a test job (its Prometheus exporter)."""
    return free_port_base(span=1)


def free_port_base(span: int = 8) -> int:
    """A first port whose `span` ports are free now: each job of these tests gets rollout ports of its own, so
    a server never answers for another job's instance (the configured default, 8100, is shared)."""
    draw = random.SystemRandom()
    for _ in range(50):
        base = draw.randrange(TEST_LISTEN_PORTS.start, TEST_LISTEN_PORTS.stop - span)
        if all(_port_free(base + i) for i in range(span)):
            return base
    raise RuntimeError(f"no {span} consecutive free ports found in {TEST_LISTEN_PORTS}")


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


LAG_BOUND = 1  # max_head_offpolicyness of `job_config`'s job


def job_config(model_dir: Path, prometheus_port: int) -> dict[str, Any]:
    """A job that finishes a step in seconds on 2 cores: batch 4 x 4 samples, answers of 2 tokens."""
    return {
        "name": "itest",
        "model_path": str(model_dir),
        "rollout_port_base": free_port_base(),
        "build_tiny_model": {
            "enabled": True, "arch": "llama", "hidden_size": 64, "num_layers": 2, "num_heads": 2,
            "num_kv_heads": 1, "intermediate_size": 128, "max_position_embeddings": 256, "init_std": 0.02,
        },
        "cluster": {"num_nodes": 1, "gpus_per_node": 2, "gpu_type": "cpu-logical", "logical_gpus": True,
                    "cpus_per_gpu": 0.5},
        "train_gpus": 1,
        "rollout_gpus": 1,
        "batch_size": 4,
        "n_samples": 4,
        "train_micro_batch_size": 4,
        "recompute_micro_batch_size": 4,
        "max_model_len": 64,
        "max_new_tokens": 2,
        "total_steps": 100,
        "max_head_offpolicyness": LAG_BOUND,
        "phase_trace_enabled": True,
        "rollout_kv_cache_bytes": 64 * 2**20,
        "rollout_enforce_eager": True,
        "rollout_weight_reload_method": "inplace",
        "megatron_use_cpu_initialization": True,
        "megatron_params_dtype": "fp32",
        "optimizer": {"lr": 1.0e-3, "clip_grad": 0},
        "task": {"name": "mod_add", "params": {"modulus": 10}, "eval_interval": 2, "eval_size": 8},
        "global_resource_planner": {"initial_allocation_strategy": "configured",
                                    "memory_budget_safety_margin_bytes": 256 * 2**20},
        "checkpoint": {"interval_steps": 2, "keep_last": 2},
        "tracking": {"backends": ["jsonl", "prometheus"], "prometheus_port": prometheus_port, "console": "plain"},
    }


class Launch:
    """`libra launch` in its own process session (so that everything it starts, apart from the rollout
    servers, which start their own sessions, shares its process group)."""

    def __init__(self, config: Path, run_dir: Path, *extra: str) -> None:
        self.log = run_dir.parent / f"launch-{int(time.time() * 1000)}.log"
        env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
        env.pop("GRPC_VERBOSITY", None)  # as a user's shell has it: set by the CLI itself (a test's main() call sets it here)
        command = [sys.executable, "-m", "libra.cli.main", "launch", str(config), "--run-dir", str(run_dir),
                   "--console", "plain", *extra]
        self._log_fh = open(self.log, "wb")
        self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=self._log_fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pgid = self.proc.pid

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log_fh.flush()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill_group(self) -> None:
        """SIGKILL everything in the launch's process group (what a crashed controller leaves behind)."""
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._log_fh.close()


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, launch: Launch | None = None,
             poll_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if launch is not None and launch.proc.poll() is not None:
            raise AssertionError(f"launch exited ({launch.proc.returncode}) before {what}:\n{launch.output()[-4000:]}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def server_pids(run_dir: Path) -> list[int]:
    """The vLLM server pids the rollout registry of the run lists (live or not)."""
    path = run_dir / "rollout" / "registry.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    return [int(e["pid"]) for e in data.get("instances", {}).values() if e.get("pid")]


def live(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def group_members(pgid: int) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            pass
    return found


def job_tree(pid: int) -> list[psutil.Process]:
    """`pid` and every process it started, as they are now (taken before a stop to check none survives it)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def survivors(tree: list[psutil.Process], grace_s: float) -> list[str]:
    """The processes of `tree` still alive (zombies aside) after `grace_s`, described by pid and command."""
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    described = []
    for proc in alive:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                described.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return described


def processes_using(path: Path) -> list[int]:
    """Live processes whose command line mentions `path` (servers, Ray workers of this run)."""
    needle = str(path)
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(needle in part for part in proc.info["cmdline"] or ()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def make_workspace(root: Path, ray_address: str = "") -> tuple[dict[str, Any], list[Launch]]:
    run_dir = root / "run"
    config = root / "itest.yaml"
    port = free_port()
    data = job_config(root / "model", port)
    if ray_address:
        data["cluster"]["ray_address"] = ray_address
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    launches: list[Launch] = []

    def launch(*extra: str) -> Launch:
        started = Launch(config, run_dir, *extra)
        launches.append(started)
        return started

    return {"root": root, "run_dir": run_dir, "config": config, "launch": launch, "port": port}, launches


@contextlib.contextmanager
def job_file(config: Path) -> Iterator[dict[str, Any]]:
    """The job file `config` as data to edit in a `with` block, written back when the block ends (left as it was
    when the block raises)."""
    data = yaml.safe_load(config.read_text())
    yield data
    config.write_text(yaml.safe_dump(data, sort_keys=False))


def with_options(config: Path, **options: Any) -> None:
    """Set top-level `options` in the job file `config`."""
    with job_file(config) as data:
        data.update(options)


def stop_everything(run_dir: Path, launches: list[Launch]) -> None:
    """Stop whatever the launches of a workspace left running (normally nothing)."""
    for started in launches:
        if started.proc.poll() is None:
            started.proc.send_signal(signal.SIGTERM)
            try:
                started.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
        started.kill_group()
    for pid in live(server_pids(run_dir)) + processes_using(run_dir):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture(scope="session")
def controller_workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A run directory and its job file (Ray started by each launch); every process left is stopped."""
    ws, launches = make_workspace(tmp_path_factory.mktemp("controller"))
    try:
        yield ws
    finally:
        stop_everything(ws["run_dir"], launches)


@contextlib.contextmanager
def cluster_holder(script: Path, args: list[str], env: dict[str, str],
                   stop_wait_s: float) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """`script` (a Python file that starts a Ray cluster, prints one JSON line about it and keeps it until its
    stdin closes) in its own process session, so the cluster outlives the controllers joining it; the process
    and that line. At the end its stdin is closed, it has `stop_wait_s` to stop the cluster, and then whatever
    is left of its session is killed."""
    holder = subprocess.Popen([sys.executable, str(script), *args], cwd=REPO, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, start_new_session=True, text=True)
    try:
        assert holder.stdout is not None
        yield holder, json.loads(holder.stdout.readline())
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        try:
            holder.wait(timeout=stop_wait_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(holder.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        holder.wait(timeout=30)


@contextlib.contextmanager
def ray_holder(gpus: int, tmp: Path, env: dict[str, str]) -> Iterator[str]:
    """A Ray cluster of `gpus` logical GPUs kept by `ray_holder.py` (see `cluster_holder`); its address."""
    with cluster_holder(Path(__file__).with_name("ray_holder.py"), [str(gpus), str(tmp)], env, 60) as (_, info):
        yield info["address"]

