"""Spec validation, the server command line per device, process-group stop, and the instance registry."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from libra.config.mapping import config_with, rollout_pool_spec
from libra.rollout.registry import InstanceRegistry, PoolRecord, RegistryEntry, RegistryError
from libra.rollout.server import (
    ServerLaunch,
    ServerProcess,
    device_env,
    log_tail,
    pid_alive,
    process_start_ticks,
    server_command,
    server_env,
)
from libra.rollout.spec import RolloutPoolSpec, RolloutSpecError


def spec_with(**fields: object) -> RolloutPoolSpec:
    """The rollout spec of a default job configuration with `fields` changed."""
    return replace(rollout_pool_spec(config_with("/m"), num_instances=1, kv_cache_bytes=64 * 2**20), **fields)  # type: ignore[arg-type]

BAD_SPECS: dict[str, tuple[dict[str, object], list[str]]] = {
    "negative instances": ({"num_instances": -1}, ["num_instances=-1"]),
    "tp zero": ({"tp_size": 0}, ["tp_size=0"]),
    "unknown method": ({"reload_method": "hot"}, ["reload_method='hot'"]),
    "unknown strategy": ({"reload_strategy": "rolling"}, ["reload_strategy='rolling'"]),
    "port in system range": ({"port_base": 80}, ["port_base=80"]),
    "endpoints while managed": ({"endpoints": ("http://h:1",)}, ["endpoints=", "manage_processes=False"]),
    "unmanaged without endpoints": ({"manage_processes": False}, ["list the server base URLs"]),
    "restart of unmanaged": (
        {"manage_processes": False, "endpoints": ("http://h:1",), "reload_method": "restart"},
        ["needs manage_processes=True"],
    ),
    "not a URL": ({"manage_processes": False, "endpoints": ("h:1",)}, ["'h:1' is not a base URL"]),
    "several at once": (
        {"tp_size": 0, "max_concurrent_requests": 0, "dtype": "int4"},
        ["tp_size", "max_conc", "dtype"],
    ),
}


@pytest.mark.parametrize("case", BAD_SPECS, ids=list(BAD_SPECS))
def test_spec_reports_every_problem(case: str) -> None:
    fields, fragments = BAD_SPECS[case]
    spec = spec_with(**fields)
    with pytest.raises(RolloutSpecError) as caught:
        spec.validate()
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_default_spec_is_valid() -> None:
    spec_with(num_instances=2).validate()


def launch(**changes: object) -> ServerLaunch:
    fields: dict[str, object] = dict(
        model_path="/m",
        port=8100,
        host="127.0.0.1",
        max_model_len=512,
        kv_cache_bytes=64 * 2**20,
        log_path="/l",
    )
    fields.update(changes)
    return ServerLaunch(**fields)  # type: ignore[arg-type]


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


@pytest.mark.parametrize(
    ("device", "tp", "expect"),
    [
        (
            "cpu",
            1,
            {
                "--dtype": "float32",
                "--kv-cache-memory-bytes": "67108864",
                "--distributed-executor-backend": "uni",
                "--max-num-batched-tokens": "2048",
            },
        ),
        (
            "cpu",
            2,
            {
                "--dtype": "float32",
                "--kv-cache-memory-bytes": "67108864",
                "--distributed-executor-backend": None,
            },
        ),
        ("cuda", 1, {"--gpu-memory-utilization": "0.5", "--kv-cache-memory-bytes": None, "--dtype": None,
                     "--max-num-batched-tokens": None}),
    ],
    ids=["cpu", "cpu-tp2", "cuda"],
)
def test_server_command_per_device(device: str, tp: int, expect: dict[str, str | None]) -> None:
    cmd = server_command(launch(tp_size=tp), device, python="py")
    # CPU servers never cut a prompt (a seeded CPU sampler cannot be rewound); CUDA keeps vLLM's default
    assert ("--no-enable-chunked-prefill" in cmd) is (device == "cpu")
    assert cmd[:2] == ["py", "-m"]
    assert flag(cmd, "--worker-extension-cls") == "libra.rollout.worker_extension.LibraWorkerExtension"
    assert flag(cmd, "--port") == "8100" and flag(cmd, "--tensor-parallel-size") == str(tp)
    assert "--enforce-eager" in cmd
    for name, value in expect.items():
        assert flag(cmd, name) == value, name


@pytest.mark.parametrize(
    ("device", "tp", "fork", "module"),
    [
        ("cpu", 1, True, "libra.rollout.forked_engine_main"),
        ("cpu", 1, False, "vllm.entrypoints.openai.api_server"),
        ("cpu", 2, True, "vllm.entrypoints.openai.api_server"),
        ("cuda", 1, True, "vllm.entrypoints.openai.api_server"),
    ],
    ids=["cpu-tp1-forks-its-engine-core", "cpu-tp1-as-shipped", "cpu-tp2-spawns-its-workers", "cuda"],
)
def test_server_module(device: str, tp: int, fork: bool, module: str) -> None:
    cmd = server_command(launch(tp_size=tp, fork_engine_core=fork), device, python="py")
    assert cmd[:3] == ["py", "-m", module]


def test_cpu_token_budget_holds_the_longest_prompt() -> None:
    cmd = server_command(replace(launch(), max_model_len=8192), "cpu", python="py")
    assert flag(cmd, "--max-num-batched-tokens") == "8192"


@pytest.mark.parametrize(
    ("gpu_ids", "tp", "cpus", "device", "eager", "expect"),
    [
        (["0"], 1, 2, "cpu", False, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0"}),
        (["5"], 1, 2, "cpu", False, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "1"}),
        (["2", "3"], 2, 8, "cpu", False, {"VLLM_CPU_OMP_THREADS_BIND": "2|3", "LIBRA_VLLM_WORKERS_WAIT_IDLE": "1"}),
        ([], 1, 2, "cpu", False, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
        (["0"], 1, 2, "cpu", True, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0",
                                    "TORCH_COMPILE_DISABLE": "1"}),
        (["0"], 1, 2, "cuda", False, {}),
        (["0"], 1, 2, "cuda", True, {}),
    ],
    ids=["cpu-core0", "cpu-gpu5-on-core1", "cpu-tp2", "cpu-no-gpu-ids", "cpu-eager-compiles-nothing", "cuda",
         "cuda-eager-keeps-vllm-compile"],
)
def test_device_env(gpu_ids: list[str], tp: int, cpus: int, device: str, eager: bool, expect: dict[str, str]) -> None:
    assert device_env(gpu_ids, device, tp, cpu_count=cpus, enforce_eager=eager) == expect


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_server_env_passes_the_launchs_eager_setting(eager: bool) -> None:
    env = server_env({"KEEP": "1"}, ["0"], "cpu", 1, eager)
    assert env["KEEP"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert ("TORCH_COMPILE_DISABLE" in env) is eager


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_a_started_server_runs_with_the_launchs_eager_setting(
        eager: bool, tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`ServerProcess.start` hands the launch's `enforce_eager` to the server's environment (the process start
    itself is replaced: a vLLM server cannot start in a unit test)."""
    started: list[dict[str, object]] = []

    class RecordedStart:
        pid = 4242

        def __init__(self, command: list[str], **kwargs: object) -> None:
            started.append(dict(kwargs, command=command))

    monkeypatch.setattr(subprocess, "Popen", RecordedStart)
    server = ServerProcess.start(launch(enforce_eager=eager, log_path=os.path.join(tmp_path, "s.log"),
                                        fork_from_forker=False), ["0"], "cpu")
    (call,) = started
    env = call["env"]
    assert isinstance(env, dict) and ("TORCH_COMPILE_DISABLE" in env) is eager
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and server.pid == 4242  # placed on its logical GPU's core
    assert ("--enforce-eager" in call["command"]) is eager


def test_launch_fingerprint_ignores_model_and_port() -> None:
    assert launch().fingerprint() == launch(model_path="/other", port=9).fingerprint()
    assert launch().fingerprint() != launch(max_model_len=1024).fingerprint()


STUBBORN_GROUP = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
print("ready", flush=True)
time.sleep(60)
"""


def test_stop_kills_the_whole_process_group_after_the_grace_period(tmp_path: os.PathLike[str]) -> None:
    """A server that ignores SIGTERM, with a child of its own, is gone (group and all) after stop()."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STUBBORN_GROUP], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        ticks = process_start_ticks(proc.pid)
        server = ServerProcess.attach(launch(), proc.pid, ticks)
        assert server.alive()
        elapsed = server.stop(timeout_s=0.5)
        proc.wait(timeout=10)
        assert 0.5 <= elapsed < 10 and not server.alive()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("a member of the server's process group survived stop()")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)



def test_stop_of_a_stopped_server_ends_it_by_sigterm_at_once() -> None:
    """A hung (SIGSTOP) server's group holds SIGTERM pending until it runs: stop() lets it run, so it ends by its
    SIGTERM at once instead of waiting out the grace period for SIGKILL."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        server = ServerProcess.attach(launch(), proc.pid, process_start_ticks(proc.pid))
        os.killpg(proc.pid, signal.SIGSTOP)
        elapsed = server.stop(timeout_s=20.0)
        assert proc.wait(timeout=10) == -signal.SIGTERM and elapsed < 10
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)

def test_pid_alive_checks_the_start_time() -> None:
    me = os.getpid()
    assert pid_alive(me) and pid_alive(me, process_start_ticks(me))
    assert not pid_alive(me, process_start_ticks(me) + 1), "a reused pid is not the recorded process"
    assert not pid_alive(0) and not pid_alive(2**22 + 12345)


def test_log_tail(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "s.log")
    with open(path, "w") as fh:
        fh.write("".join(f"line {i}\n" for i in range(100)))
    assert log_tail(path, 3) == "line 97\nline 98\nline 99"
    assert "no log" in log_tail(os.path.join(tmp_path, "missing.log"))


def entry(iid: str) -> RegistryEntry:
    return RegistryEntry(
        instance_id=iid, host="127.0.0.1", hostname="h", port=8100, pid=42, start_ticks=7, gpu_ids=["0"],
        weight_version=3, checksum="sha256t1:x", model_path="/m", actor_name=f"a-{iid}",
        fingerprint={"tp_size": 1}, log_path="/l", started_at=1.0,
    )  # fmt: skip


def test_registry_round_trip_and_atomic_write(tmp_path: os.PathLike[str]) -> None:
    registry = InstanceRegistry(str(tmp_path))
    assert registry.load() == PoolRecord()
    record = PoolRecord(weight_version=3, model_path="/m", checksum="sha256t1:x", entries={"r0": entry("r0")})
    registry.save(record)
    assert registry.load() == record
    assert os.listdir(os.path.dirname(registry.path)) == ["registry.json"], "no temp file is left behind"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "unreadable"),
        (json.dumps({"schema": 99}), "schema 99"),
        (json.dumps({"schema": 1, "instances": {"r0": {"instance_id": "r0"}}}), "lacks fields"),
    ],
    ids=["corrupt", "schema", "fields"],
)
def test_registry_errors_name_the_file(tmp_path: os.PathLike[str], content: str, message: str) -> None:
    registry = InstanceRegistry(str(tmp_path))
    os.makedirs(os.path.dirname(registry.path))
    with open(registry.path, "w") as fh:
        fh.write(content)
    with pytest.raises(RegistryError, match=message) as caught:
        registry.load()
    assert registry.path in str(caught.value) or message == "lacks fields"
