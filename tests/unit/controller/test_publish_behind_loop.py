"""The weight publish under a policy lag (fake pools, the real RL loop and producer): the training ranks export
at the step boundary, the rollout servers reload while the next step collects and trains, and the loop waits
for the ACKs at the next sync point; a synchronous job waits at once. The reload's figures land in the row of
the step that waited for it, an evaluation sees the policy it names, a failed reload fails the job at the next
step, and a loop that stops lets a running reload finish."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from libra.config import load_dict
from libra.controller.desired_store import DesiredStore
from libra.controller.events import EventLog
from libra.controller.reporting import Reporter
from libra.controller.rl_loop import RLLoop
from libra.controller.services import JobSession
from libra.controller.signals import StopRequest
from libra.controller.state import DesiredState, TrainLayout
from libra.observability.console import NullConsole
from libra.run_dir import RunDir

from .test_training_restart import Completion, Prompt, Task, Tokenizer

END_STEP = 6
RELOAD_S = 0.4  # a reload's length where no step may train during it (long beside a fake step's milliseconds)
NEXT_STEP_BOUND_S = 30.0  # how long a reload waits for the next step to start where one may (it starts at once)


class EvalTask(Task):
    def eval_prompts(self, n: int) -> list[Prompt]:
        return [Prompt([9, 9]) for _ in range(2)]


class StepStarts:
    """When each training step started, and an event per step that a reload can wait for."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}
        self._events: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def event(self, step: int) -> threading.Event:
        with self._lock:
            return self._events.setdefault(step, threading.Event())

    def started(self, step: int) -> None:
        self.at[step] = time.monotonic()
        self.event(step).set()


class SlowReloadRollout:
    """Rollout servers whose reload of version v lasts until training step v + 1 starts, or `wait_s` at most
    (timing alone would make a loaded machine's scheduling part of the result); generation answers with the
    version served. Records when each reload started and ended, the versions the evaluation's (greedy)
    requests met, and fails the reload of `fail_at`."""

    def __init__(self, steps: StepStarts, wait_s: float, fail_at: int | None = None) -> None:
        self.steps, self.wait_s = steps, wait_s
        self.version = 0
        self.calls = 0
        self.fail_at = fail_at
        self.reloads: dict[int, tuple[float, float]] = {}
        self.eval_versions: list[int] = []

    def publish_weights(self, version: int, hf_dir: str, checksum: str) -> dict[str, Any]:
        started = time.monotonic()
        assert Path(hf_dir).is_dir(), f"the export of version {version} is gone before its reload: {hf_dir}"
        self.steps.event(version + 1).wait(self.wait_s)
        time.sleep(0.01)
        if version == self.fail_at:
            raise RuntimeError(f"instance rollout-0 refused the reload of version {version}")
        self.version = version
        self.reloads[version] = (started, time.monotonic())
        return {}

    async def generate(self, prompt_ids: list[int], n: int = 1, **sampling: Any) -> list[Completion]:
        self.calls += 1
        if sampling.get("temperature") == 0.0:
            self.eval_versions.append(self.version)
        return [Completion([self.calls + i, 3], [-0.5, -0.5], "stop", self.version) for i in range(n)]


class RecordingTraining:
    """Training ranks that note when each step started; `stop` is requested when step `stop_after` ends."""

    def __init__(self, steps: StepStarts, stop: StopRequest, stop_after: int | None = None) -> None:
        self.steps, self.stop, self.stop_after = steps, stop, stop_after
        self.step = 0

    @property
    def started(self) -> dict[int, float]:
        return self.steps.at

    def train_step(self, samples: list[Any], step: int) -> dict[str, float]:
        self.steps.started(step)
        self.step = step
        if step == self.stop_after:
            self.stop.request("operator stop")
        return {"loss": 0.1, "tokens": float(len(samples) * 2)}

    def export_hf(self, out_dir: str) -> str:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        return "sha256t1:fake"


def make_loop(tmp_path: Path, lag: int, rollout: SlowReloadRollout, stop_after: int | None = None,
              eval_interval: int = 0) -> tuple[RLLoop, RunDir, RecordingTraining]:
    cfg = load_dict({"model_path": str(tmp_path / "m"), "rollout_kv_cache_bytes": 2**26,
                     "cluster": {"gpu_type": "cpu-logical", "logical_gpus": True, "gpus_per_node": 2},
                     "train_gpus": 1, "rollout_gpus": 1, "megatron_params_dtype": "fp32", "max_model_len": 256,
                     "max_new_tokens": 2, "batch_size": 2, "n_samples": 2, "total_steps": END_STEP,
                     "max_head_offpolicyness": lag, "megatron_use_cpu_initialization": True,
                     "optimizer": {"clip_grad": 0}, "task": {"eval_interval": eval_interval, "eval_size": 2},
                     "checkpoint": {"interval_steps": 0},
                     "build_tiny_model": {"enabled": True, "num_heads": 2, "num_kv_heads": 1}})
    run = RunDir.at(tmp_path / "run").create()
    events = EventLog(run.events_jsonl)
    stop = StopRequest()
    training = RecordingTraining(rollout.steps, stop, stop_after)
    store = DesiredStore(None, DesiredState(rollout_instances=1, rollout_tp=1, train_gpus=1, train_layout=TrainLayout()))
    session = JobSession(training=training, generation=rollout, desired=store,  # type: ignore[arg-type]
                         publish_weights=rollout.publish_weights, served_versions=lambda: [rollout.version],
                         wake_reconciler=lambda: None, pool_status=dict, pool_text=dict, tick_errors=lambda: 0)
    loop = RLLoop(cfg, run, session, events, Reporter(run, "t", END_STEP, NullConsole(), events, None),
                  EvalTask(), Tokenizer(), stop, END_STEP)
    loop.restore()
    return loop, run, training


def run_steps(loop: RLLoop) -> None:
    try:
        loop.run_steps()
    finally:
        loop.stop_producer()


def metric_rows(run: RunDir) -> list[dict[str, Any]]:
    return [json.loads(line) for line in run.metrics_jsonl.read_text().splitlines()]


def trained_during_the_reload_before(rollout: SlowReloadRollout, training: RecordingTraining) -> list[int]:
    """The published versions v whose reload had not ended when step v + 1 started training: the step did not
    wait for the ACKs. (Whether the reload's thread got to run before the step started is the scheduler's
    business, so when it started is not asked.)"""
    return [v for v, (_, end) in sorted(rollout.reloads.items()) if training.started.get(v + 1, end) < end]


def publish_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("libra-publish")]


@pytest.mark.parametrize(("lag", "behind"), [
    pytest.param(0, False, id="synchronous-waits-for-the-acks"),
    pytest.param(1, True, id="lag-1-trains-during-the-reload"),
    pytest.param(2, True, id="lag-2-trains-during-the-reload"),
])
def test_the_next_step_trains_while_the_servers_reload_under_a_lag(tmp_path: Path, lag: int, behind: bool) -> None:
    rollout = SlowReloadRollout(StepStarts(), NEXT_STEP_BOUND_S if behind else RELOAD_S)
    loop, run, training = make_loop(tmp_path, lag, rollout)
    run_steps(loop)
    published = list(range(1, END_STEP))
    assert sorted(rollout.reloads) == published and rollout.version == END_STEP - 1
    assert trained_during_the_reload_before(rollout, training) == (published if behind else [])
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == list(range(1, END_STEP + 1))
    # a reload's figures are in the row of the step that waited for it: the next one when it ran behind
    waited_at = {r["sync_version"]: r["step"] for r in rows if "sync_version" in r}
    assert waited_at == {v: v + 1 if behind else v for v in published}
    assert all(r["sync_total_s"] >= 0.01 for r in rows if "sync_version" in r)
    exported = [r["step"] for r in rows if "sync_export_s" in r]
    assert exported == (published if behind else [])
    assert [r["rollout_version"] for r in rows][-1] == END_STEP - 1
    assert [v for v, _ in run.weight_versions()] == [END_STEP - 1], "older exports pruned, the served one kept"
    assert not publish_threads()


def test_an_evaluation_sees_the_policy_it_names_when_the_reload_runs_behind(tmp_path: Path) -> None:
    """The evaluation waits for the reload of the weights it names; the next step trains meanwhile, and the
    evaluation's result is taken after it, before the next publish."""
    rollout = SlowReloadRollout(StepStarts(), NEXT_STEP_BOUND_S)
    loop, run, training = make_loop(tmp_path, 1, rollout, eval_interval=2)
    run_steps(loop)
    assert trained_during_the_reload_before(rollout, training) == list(range(1, END_STEP))
    rows = metric_rows(run)
    evaluated = {r["eval_step"]: r["step"] for r in rows if "eval_step" in r}
    assert evaluated == {2: 3, 4: 5, 6: 6}
    # two held-out prompts per evaluation; the last one (in the foreground) meets the last published weights
    assert rollout.eval_versions == [2, 2, 4, 4, 5, 5]


@pytest.mark.parametrize("lag", [pytest.param(0, id="synchronous"), pytest.param(1, id="lag-1")])
def test_a_failed_reload_fails_the_job_with_its_error(tmp_path: Path, lag: int) -> None:
    rollout = SlowReloadRollout(StepStarts(), NEXT_STEP_BOUND_S if lag else RELOAD_S, fail_at=3)
    loop, run, training = make_loop(tmp_path, lag, rollout)
    with pytest.raises(RuntimeError, match="refused the reload of version 3"):
        run_steps(loop)
    # behind the loop the error meets the next step's sync point: step 4 trained, never got its row
    assert max(training.started) == (4 if lag else 3)
    assert [r["step"] for r in metric_rows(run)] == [1, 2] + ([3] if lag else [])
    assert rollout.version == 2
    assert not publish_threads()


@pytest.mark.parametrize("fails", [pytest.param(False, id="reload-succeeds"), pytest.param(True, id="reload-fails")])
def test_a_loop_that_stops_lets_the_running_reload_finish(tmp_path: Path, fails: bool) -> None:
    """A stop after step 3: its reload, running behind the loop, ends before the loop does; its error (nothing
    waits for that step any more) reaches the event log and the loop ends as asked."""
    rollout = SlowReloadRollout(StepStarts(), RELOAD_S, fail_at=3 if fails else None)  # no step 4 will start
    loop, run, _ = make_loop(tmp_path, 1, rollout, stop_after=3)
    run_steps(loop)
    assert loop.state.step == 3 and [r["step"] for r in metric_rows(run)] == [1, 2, 3]
    served = 2 if fails else 3
    assert rollout.version == served, "the publish of the last step trained ended before the loop did"
    assert loop.rollout_version == served and loop.session.desired.get().weight_version == served
    warnings = [e["message"] for e in map(json.loads, run.events_jsonl.read_text().splitlines())
                if e["kind"] == "warning"]
    assert warnings == (["weight publish of step 3 failed: RuntimeError: instance rollout-0 refused the reload of "
                         "version 3"] if fails else [])
    assert not publish_threads()
