"""A training worker lost (died or hung) during a step (fake pools): the RL loop has the session restart the
training pool, goes back to the newest complete checkpoint (never one the dead worker left half-written), trains the later
steps again and counts each step once; a worker lost again and again fails the job with a clear error, and
any other training error fails it unchanged."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from libra.cluster.training_workers import WorkerHungError, WorkerLostError
from libra.config import load_dict
from libra.controller.desired_store import DesiredStore
from libra.controller.events import EventLog
from libra.controller.pools import training_worker_loss
from libra.controller.reporting import Reporter
from libra.controller.rl_loop import RLLoop, TrainingWorkersLostError
from libra.controller.services import JobSession
from libra.controller.signals import StopRequest
from libra.controller.state import DesiredState, TrainLayout
from libra.observability.console import NullConsole
from libra.run_dir import CorruptRunStateError, RunDir

END_STEP = 6


@dataclass
class Prompt:
    token_ids: list[int]


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


class Task:
    def train_prompts(self, seed: int) -> Any:
        index = 0
        while True:
            index += 1
            yield Prompt([index % 7 + 1, 2])

    def reward(self, prompt: Any, response_ids: list[int], text: str) -> float:
        return float(response_ids[0] % 2)


class Tokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


class Rollout:
    def __init__(self) -> None:
        self.version = 0
        self.calls = 0

    def publish_weights(self, version: int, hf_dir: str, checksum: str) -> dict[str, Any]:
        self.version = version
        return {}

    async def generate(self, prompt_ids: list[int], n: int = 1, **sampling: Any) -> list[Completion]:
        self.calls += 1
        return [Completion([self.calls + i, 3], [-0.5, -0.5], "stop", self.version) for i in range(n)]


class Training:
    """A training pool whose worker dies in the calls named by `deaths` ((method, step) pairs, or `always`), and
    hangs (its call outlives the deadline) in those named by `hangs`."""

    def __init__(self, deaths: set[tuple[str, int]], always: bool = False, other_error: bool = False,
                 hangs: set[tuple[str, int]] = frozenset()) -> None:  # type: ignore[assignment]
        self.deaths = set(deaths)
        self.hangs = set(hangs)
        self.always = always
        self.other_error = other_error
        self.step = 0
        self.trained: list[int] = []
        self.restarts = 0

    def _maybe_die(self, method: str, step: int) -> None:
        if self.other_error:
            raise ValueError("a bug in the loss")
        if self.always or (method, step) in self.deaths:
            self.deaths.discard((method, step))
            try:
                raise WorkerLostError(f"libra-train.{method}: the process of rank(s) [0] died", [0])
            except WorkerLostError as lost:  # the pool's wrapper re-raises with the worker error as cause
                raise RuntimeError(f"{method} failed") from lost
        if (method, step) in self.hangs:
            self.hangs.discard((method, step))
            raise WorkerHungError(f"libra-train.{method}: rank(s) [0] did not finish within 30s", [0])

    def train_step(self, samples: list[Any], step: int) -> dict[str, float]:
        self._maybe_die("train_step", step)
        self.trained.append(step)
        self.step = step
        return {"loss": 0.1, "tokens": float(len(samples) * 2)}

    def export_hf(self, out_dir: str) -> str:
        self._maybe_die("export_hf", self.step)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        return "sha256t1:fake"

    def save_checkpoint(self, ckpt_dir: str, step: int) -> str:
        (Path(ckpt_dir) / "partial").write_text("written before the worker died")
        self._maybe_die("save_checkpoint", step)
        (Path(ckpt_dir) / "step.json").write_text(json.dumps({"step": step}))
        return ckpt_dir

    def load_checkpoint(self, ckpt_dir: str) -> int:
        self.step = int(json.loads((Path(ckpt_dir) / "step.json").read_text())["step"])
        return self.step

    def restart(self, exc: BaseException) -> dict[str, Any] | None:
        assert training_worker_loss(exc), f"asked to restart after an error that is no lost worker: {exc!r}"
        self.restarts += 1
        self.step = 0  # the new workers hold the initial weights
        return {"switch_s": 0.5}


def raised_from(error: Exception, message: str) -> RuntimeError:
    """`RuntimeError(message)` raised from `error` (cause and context set), as a pool call wraps what failed
    under it."""
    try:
        try:
            raise error
        except Exception as inner:
            raise RuntimeError(message) from inner
    except RuntimeError as outer:
        return outer


def run_loop(tmp_path: Path, training: Training, replan_onto_capacity: Any = None,
             rollout: Rollout | None = None, restart_limit: int | None = None) -> tuple[RLLoop, RunDir]:
    loop, run = make_loop(tmp_path, training, replan_onto_capacity, rollout, restart_limit)
    try:
        loop.run_steps()
    finally:
        loop.stop_producer()
    return loop, run


def make_loop(tmp_path: Path, training: Training, replan_onto_capacity: Any = None,
              rollout: Rollout | None = None, restart_limit: int | None = None) -> tuple[RLLoop, RunDir]:
    planner = {} if restart_limit is None else {"runtime_training_restart_limit": restart_limit}
    cfg = load_dict({"global_resource_planner": planner,"model_path": str(tmp_path / "m"), "rollout_kv_cache_bytes": 2**26,
                     "cluster": {"gpu_type": "cpu-logical", "logical_gpus": True, "gpus_per_node": 2},
                     "train_gpus": 1, "rollout_gpus": 1, "megatron_params_dtype": "fp32", "max_model_len": 256,
                     "max_new_tokens": 2, "batch_size": 2, "n_samples": 2, "total_steps": END_STEP,
                     "max_head_offpolicyness": 0, "megatron_use_cpu_initialization": True,
                     "optimizer": {"clip_grad": 0}, "task": {"eval_interval": 0},
                     "checkpoint": {"interval_steps": 2, "keep_last": 5},
                     "build_tiny_model": {"enabled": True, "num_heads": 2, "num_kv_heads": 1}})
    run = RunDir.at(tmp_path / "run").create()
    events = EventLog(run.events_jsonl)
    rollout = rollout or Rollout()
    store = DesiredStore(None, DesiredState(rollout_instances=1, rollout_tp=1, train_gpus=1, train_layout=TrainLayout()))
    session = JobSession(training=training, generation=rollout, desired=store,  # type: ignore[arg-type]
                         publish_weights=rollout.publish_weights, served_versions=lambda: [rollout.version],
                         wake_reconciler=lambda: None, pool_status=dict, pool_text=dict, tick_errors=lambda: 0,
                         training_loss=training_worker_loss, restart_training=training.restart,
                         replan_onto_capacity=replan_onto_capacity)
    loop = RLLoop(cfg, run, session, events, Reporter(run, "t", END_STEP, NullConsole(), events, None), Task(),
                  Tokenizer(), StopRequest(), END_STEP)
    loop.restore()
    return loop, run


def _events(run: RunDir, kind: str) -> list[dict[str, Any]]:
    return [e for e in map(json.loads, run.events_jsonl.read_text().splitlines()) if e["kind"] == kind]


@pytest.mark.parametrize(
    ("deaths", "trained", "resumed", "repeated"),
    [
        pytest.param({("train_step", 3)}, [1, 2, 3, 4, 5, 6], [2], [0], id="mid-step-after-a-checkpoint"),
        pytest.param({("train_step", 4)}, [1, 2, 3, 3, 4, 5, 6], [2], [1], id="mid-step-repeats-the-step-after-it"),
        pytest.param({("train_step", 1)}, [1, 2, 3, 4, 5, 6], [0], [0], id="before-any-checkpoint"),
        pytest.param({("save_checkpoint", 4)}, [1, 2, 3, 4, 3, 4, 5, 6], [2], [1],
                     id="mid-checkpoint-write-resumes-the-one-before"),
        pytest.param({("train_step", 3), ("save_checkpoint", 6)}, [1, 2, 3, 4, 5, 6, 5, 6], [2, 4], [0, 1],
                     id="two-losses"),
    ],
)
def test_a_lost_worker_resumes_from_the_newest_complete_checkpoint(
        tmp_path: Path, deaths: set[tuple[str, int]], trained: list[int], resumed: list[int], repeated: list[int]) -> None:
    training = Training(deaths)
    loop, run = run_loop(tmp_path, training)
    assert loop.state.step == END_STEP and training.trained == trained
    assert training.restarts == len(resumed) == loop.training_restarts
    rows = [json.loads(line) for line in run.metrics_jsonl.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, END_STEP + 1)), "each step counted once"
    assert [r["step"] for r in loop.rows] == list(range(1, END_STEP + 1))
    assert [e["step"] for e in _events(run, "resumed")] == resumed
    recovered = _events(run, "train_recovered")
    assert [e["steps_repeated"] for e in recovered] == repeated
    assert [e["lost_step"] for e in _events(run, "train_recovered")] == [s for _, s in sorted(deaths, key=lambda d: d[1])]
    assert len(_events(run, "train_worker_lost")) == len(resumed)


@pytest.mark.parametrize(
    ("hangs", "trained"),
    [
        pytest.param({("train_step", 4)}, [1, 2, 3, 3, 4, 5, 6], id="mid-step"),
        pytest.param({("export_hf", 3)}, [1, 2, 3, 3, 4, 5, 6], id="mid-weight-export-after-the-step"),
        pytest.param({("save_checkpoint", 4)}, [1, 2, 3, 4, 3, 4, 5, 6], id="mid-checkpoint-write"),
    ],
)
def test_a_hung_worker_is_recovered_as_a_lost_one_and_said_so(
        tmp_path: Path, hangs: set[tuple[str, int]], trained: list[int]) -> None:
    training = Training(set(), hangs=hangs)
    loop, run = run_loop(tmp_path, training)
    assert loop.state.step == END_STEP and training.trained == trained and training.restarts == 1
    rows = [json.loads(line) for line in run.metrics_jsonl.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, END_STEP + 1)), "each step counted once"
    [lost] = _events(run, "train_worker_lost")
    assert lost["how"] == "hung" and "a training worker hung during step" in lost["message"]
    [recovered] = _events(run, "train_recovered")
    assert recovered["lost_step"] == min(step for _, step in hangs)


@pytest.mark.parametrize(
    ("error", "how"),
    [
        pytest.param(WorkerLostError("rank 0 died", [0]), "died", id="died"),
        pytest.param(WorkerHungError("rank 0 did not finish", [0]), "hung", id="hung"),
        pytest.param(ValueError("a bug in the loss"), "", id="another-error"),
    ],
)
def test_how_a_worker_was_lost_is_read_through_the_chain_of_causes(error: Exception, how: str) -> None:
    assert training_worker_loss(raised_from(error, "train_step failed")) == how


@pytest.mark.parametrize(("limit", "restarts"), [
    pytest.param(None, 3, id="default-3"),
    pytest.param(0, 0, id="0-stops-at-the-first-loss"),
    pytest.param(1, 1, id="1"),
    pytest.param(5, 5, id="5"),
])
def test_a_worker_lost_again_and_again_fails_the_job(tmp_path: Path, limit: int | None, restarts: int) -> None:
    """runtime_training_restart_limit restarts in a row, then the next loss stops the job without restarting."""
    training = Training(set(), always=True)
    with pytest.raises(TrainingWorkersLostError, match="times in a row without saving a checkpoint") as failure:
        run_loop(tmp_path, training, restart_limit=limit)
    assert training.restarts == restarts
    assert f"lost a worker {restarts + 1} times in a row" in str(failure.value)
    assert f"runtime_training_restart_limit {restarts}" in str(failure.value)
    assert "launch the job again on this run directory" in str(failure.value)
    assert failure.value.__cause__ is not None
    assert failure.value.__cause__.__cause__.__class__ is WorkerLostError


def test_another_training_error_is_not_a_lost_worker(tmp_path: Path) -> None:
    training = Training(set(), other_error=True)
    with pytest.raises(ValueError, match="a bug in the loss"):
        run_loop(tmp_path, training)
    assert training.restarts == 0


class NodeLost:
    """The session's capacity check: before step `before_step` it reports a re-plan (restarting the training
    pool when `restarts`, whose ranks then hold the initial weights), or raises `error`; None otherwise."""

    def __init__(self, training: Training, before_step: int, restarts: bool, error: Exception | None = None) -> None:
        self.training = training
        self.before_step = before_step
        self.restarts = restarts
        self.error = error
        self.calls = 0

    def __call__(self) -> dict[str, Any] | None:
        self.calls += 1
        if self.training.step + 1 != self.before_step:
            return None
        self.before_step = -1  # once
        if self.error is not None:
            raise self.error
        if self.restarts:
            self.training.step = 0
        return {"training_restarted": self.restarts, "seconds": 1.0}


@pytest.mark.parametrize(
    ("before_step", "restarts", "trained", "resumed", "repeated"),
    [
        pytest.param(4, True, [1, 2, 3, 3, 4, 5, 6], [2], [1], id="training-restarted-back-to-the-checkpoint"),
        pytest.param(5, True, [1, 2, 3, 4, 5, 6], [4], [0], id="right-after-a-checkpoint-nothing-repeated"),
        pytest.param(4, False, [1, 2, 3, 4, 5, 6], [], [], id="rollout-only-the-loop-goes-on"),
    ],
)
def test_a_node_lost_at_a_step_boundary(tmp_path: Path, before_step: int, restarts: bool, trained: list[int],
                                        resumed: list[int], repeated: list[int]) -> None:
    training = Training(set())
    check = NodeLost(training, before_step, restarts)
    loop, run = run_loop(tmp_path, training, check)
    assert loop.state.step == END_STEP and training.trained == trained
    assert check.calls >= END_STEP
    rows = [json.loads(line) for line in run.metrics_jsonl.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, END_STEP + 1)), "each step counted once"
    assert [e["step"] for e in _events(run, "resumed")] == resumed
    recovered = _events(run, "train_recovered")
    assert [e["steps_repeated"] for e in recovered] == repeated
    assert all("the cluster lost GPUs before step" in e["message"] for e in recovered)
    assert loop.training_restarts == 0  # no worker was lost: nothing counts towards runtime_training_restart_limit


def test_pools_that_no_longer_fit_stop_the_job(tmp_path: Path) -> None:
    from libra.controller.capacity import CapacityLost

    training = Training(set())
    with pytest.raises(CapacityLost, match="the job stops"):
        run_loop(tmp_path, training, NodeLost(training, 3, True, CapacityLost("2 GPUs left; the job stops")))
    assert training.trained == [1, 2]


def test_an_error_after_a_restart_for_a_lost_node_writes_no_checkpoint_of_the_initial_weights(tmp_path: Path) -> None:
    """The training pool restarted for a lost node holds the initial weights until the loop is back on its
    checkpoint; when that fails (no checkpoint loads), the job stops and the shutdown's checkpoint is not
    written from the restarted pool (it would label the initial weights with the step the loop had reached)."""
    training = Training(set())
    check = NodeLost(training, 4, True)

    def replan() -> dict[str, Any] | None:
        outcome = check()
        if outcome:
            def unreadable(ckpt_dir: str) -> int:
                raise OSError(f"{ckpt_dir}: a shard cannot be read")

            training.load_checkpoint = unreadable  # type: ignore[method-assign]
        return outcome

    loop, run = make_loop(tmp_path, training, replan)
    try:
        with pytest.raises(CorruptRunStateError, match="a shard cannot be read"):
            loop.run_steps()
    finally:
        loop.stop_producer()
    assert loop.state.step == 3
    saved = sorted(p.name for p in run.checkpoints.iterdir())
    loop.final_checkpoint()
    assert sorted(p.name for p in run.checkpoints.iterdir()) == saved, "a checkpoint of the initial weights"


def _metric_steps(run: RunDir) -> list[int]:
    return [json.loads(line)["step"] for line in run.metrics_jsonl.read_text().splitlines() if line.strip()]


def test_a_steps_checkpoint_is_complete_only_after_its_metrics_row(tmp_path: Path) -> None:
    """A controller killed between the two writes must not resume after a step that has no row."""
    loop, run = make_loop(tmp_path, Training(set()))
    complete_at_row: dict[int, int] = {}
    report = loop.reporter.step

    def step(row: dict[str, Any], *args: Any) -> None:
        newest = run.latest_checkpoint()
        complete_at_row[row["step"]] = newest[0] if newest else 0
        report(row, *args)

    loop.reporter.step = step  # type: ignore[method-assign]
    try:
        loop.run_steps()
    finally:
        loop.stop_producer()
    # checkpoints every 2 steps: when row 2 is written the newest complete checkpoint is still none, at row 4 it is 2
    assert complete_at_row == {1: 0, 2: 0, 3: 2, 4: 2, 5: 4, 6: 4}
    assert [s for s, _ in run.checkpoints_by_step()] == [2, 4, 6]
    assert _metric_steps(run) == list(range(1, END_STEP + 1))


@pytest.mark.parametrize("stop_at", [pytest.param(4, id="a-step-with-a-checkpoint-due"),
                                     pytest.param(3, id="a-step-without")])
def test_a_stop_between_a_step_and_its_row_keeps_every_checkpointed_step_with_its_row(
        tmp_path: Path, stop_at: int) -> None:
    """A loop that stops after training a step and before writing its row (here the step's hook fails) leaves
    no complete checkpoint of that step, also not the shutdown's; the resume trains the step again."""
    loop, run = make_loop(tmp_path, Training(set()))

    def after_step(rows: list[dict[str, Any]]) -> None:
        if rows[-1]["step"] == stop_at:
            raise RuntimeError("the step's hook failed")

    loop.session = dataclasses.replace(loop.session, after_step=after_step)
    try:
        with pytest.raises(RuntimeError, match="the step's hook failed"):
            loop.run_steps()
    finally:
        loop.stop_producer()
    loop.final_checkpoint()
    assert [s for s, _ in run.checkpoints_by_step()] == [2]
    assert _metric_steps(run) == list(range(1, stop_at))
    assert [e["step"] for e in _events(run, "checkpoint_skipped")] == [stop_at]
    again, _ = run_loop(tmp_path, Training(set()))
    assert again.start_step == 2
    assert _metric_steps(run) == list(range(1, END_STEP + 1))
