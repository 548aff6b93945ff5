"""A job for the operator API's unit tests: the real tracker, executor, control loop and desired-state store
over the fake pool edges of tests/unit/controller/fakes.py, and the same reconfiguration path as the
controller (`plan_reconfigure` through the store, `finish_if_converged` after each tick)."""

from __future__ import annotations

import time
from pathlib import Path

from libra.config import Config, load
from libra.controller.control_loop import ControlLoop
from libra.controller.desired_store import DesiredStore
from libra.controller.events import EventLog
from libra.controller.executor import Executor
from libra.controller.reconfigure import (
    ReconfigureLimits,
    ReconfigureTarget,
    finish_if_converged,
    plan_reconfigure,
)
from libra.controller.signals import StopRequest
from libra.controller.state import DesiredState, ObservedState, TrainLayout
from libra.controller.step_gate import StepGate
from libra.controller.tracker import MemberTracker
from libra.run_dir import RunDir

from ..controller.fakes import FakeRolloutEdge, FakeTrainingEdge

REPO = Path(__file__).resolve().parents[3]


def job_config(run_dir: Path, *overrides: str) -> Config:
    """configs/dev.yaml with its split pinned (2 + 2 of 4 GPUs) and runtime reconfiguration on."""
    return load(str(REPO / "configs" / "dev.yaml"), [
        f"run_dir={run_dir}", "global_resource_planner.initial_allocation_strategy=configured",
        "global_resource_planner.runtime_dynamic_reconfiguration_enabled=true", *overrides])


class FakeJob:
    def __init__(self, tmp_path: Path, cfg: Config | None = None, instances: int = 2) -> None:
        self.run = RunDir.at(tmp_path / "run").create()
        self.cfg = cfg or job_config(self.run.root)
        self.events = EventLog(self.run.events_jsonl)
        self.stop = StopRequest()
        self.step_gate = StepGate()
        self.current_step = 3
        self.tracker = MemberTracker(self.events)
        self.rollout = FakeRolloutEdge()
        self.train = FakeTrainingEdge()
        self.executor = Executor(self.tracker, self.rollout, self.train, self.events)
        self.store = DesiredStore(self.run.desired_state_json, DesiredState(
            rollout_instances=instances, rollout_tp=1, train_gpus=2, train_layout=TrainLayout(), cluster_gpus=4,
            reconfigure_strategy=self.cfg.global_resource_planner.runtime_rollout_reconfigure_strategy))
        self.loop = ControlLoop(self.tracker, self.executor, self.rollout, self.train, self.store.get, self.events,
                                on_observed=self._on_observed)
        self.settle()

    # ---- JobControl -------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.current_step

    @property
    def desired(self) -> DesiredState | None:
        return self.store.get()

    def observed_state(self) -> ObservedState | None:
        return self.tracker.snapshot(time.time(), take_errors=False)

    def reconfigure_limits(self) -> ReconfigureLimits:
        gpr = self.cfg.global_resource_planner
        return ReconfigureLimits(enabled=gpr.runtime_dynamic_reconfiguration_enabled, cluster_swap_enabled=False,
                                 gpus_per_node=self.cfg.cluster.gpus_per_node, model=self.cfg.model_spec(),
                                 drain_before_stop=True, fingerprint_for=lambda tp: "")

    def request_reconfigure(self, target: ReconfigureTarget, strategy: str | None = None) -> DesiredState:
        observed = self.tracker.snapshot(time.time(), take_errors=False)
        limits = self.reconfigure_limits()
        desired = self.store.change(lambda now: plan_reconfigure(now, target, strategy, limits, observed))
        self.events.emit("reconfigure_requested", desired.reconfiguring, generation=desired.generation,
                         strategy=desired.reconfigure_strategy)
        return desired

    # ---- driving ----------------------------------------------------------------------------------------
    def _on_observed(self, observed: ObservedState, desired: DesiredState) -> None:
        done = finish_if_converged(observed, desired)
        if done is not None and self.store.replace_if(desired, done):
            self.events.emit("reconfigure_done", desired.reconfiguring, generation=desired.generation,
                             strategy=desired.reconfigure_strategy, seconds=0.5)

    def settle(self, ticks: int = 12) -> None:
        for _ in range(ticks):
            self.loop.tick()
            assert self.executor.wait_idle(5)

    def close(self) -> None:
        self.executor.shutdown()
