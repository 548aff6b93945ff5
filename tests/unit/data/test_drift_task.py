"""The drifting workload: its length schedule, the budgets its prompts carry (resumed streams continue them),
its parameter errors, and the rollout producer asking the pool for each prompt's budget."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from libra.controller.batching import SampleBuffer
from libra.controller.events import EventLog
from libra.controller.producer import RolloutProducer, SamplingSettings
from libra.data import build_task
from libra.data.drift_task import LengthSchedule
from libra.data.prompt import RESPONSE_BUDGET_KEY, Prompt, TaskError, response_budget
from libra.data.registry import TaskSpec
from planner.sim.lengths import LengthModel


@pytest.mark.parametrize(("start", "end", "ramp", "index", "budget"), [
    (8, 64, 100, 0, 8),
    (8, 64, 100, 50, 36),
    (8, 64, 100, 100, 64),
    (8, 64, 100, 10_000, 64),
    (4, 4, 10, 5, 4),
    (4, 48, 640, 320, 26),
    (1, 2, 3, 1, 1),
    (1, 2, 3, 2, 2),
], ids=["first", "half", "end-of-ramp", "after-ramp", "flat", "drift-yaml-step-20", "rounds-down", "rounds-up"])
def test_schedule(start: int, end: int, ramp: int, index: int, budget: int) -> None:
    assert LengthSchedule(start, end, ramp).budget(index) == budget


@pytest.mark.parametrize(("start", "end", "ramp"), [(8, 64, 100), (4, 48, 640), (1, 2, 3)],
                         ids=["dev-default", "drift-yaml", "tiny"])
def test_schedule_is_the_simulators_drift_curve(start: int, end: int, ramp: int) -> None:
    """The task and the simulator drift along one curve: budget of prompt k = the simulated mean at k / ramp
    of a job whose mean ramps over the whole job (rounded to whole tokens)."""
    model = LengthModel(start, end, max_new_tokens=end, ramp=1.0)
    for index in range(0, 2 * ramp, max(1, ramp // 7)):
        assert LengthSchedule(start, end, ramp).budget(index) == round(model.mean_at(index / ramp))


def test_schedule_never_shrinks() -> None:
    schedule = LengthSchedule(3, 47, 333)
    budgets = [schedule.budget(i) for i in range(500)]
    assert budgets == sorted(budgets) and budgets[0] == 3 and budgets[-1] == 47


def _drift(tiny_tokenizer: Any, **params: Any) -> Any:
    return build_task(TaskSpec(name="drift", params={"start_tokens": 4, "end_tokens": 20, "ramp_prompts": 8,
                                                     **params}), tiny_tokenizer)


def test_prompts_carry_growing_budgets(tiny_tokenizer: Any) -> None:
    task = _drift(tiny_tokenizer)
    prompts = list(itertools.islice(task.train_prompts(seed=3), 12))
    assert [p.metadata[RESPONSE_BUDGET_KEY] for p in prompts] == [4, 6, 8, 10, 12, 14, 16, 18, 20, 20, 20, 20]
    assert [p.metadata["stream_index"] for p in prompts] == list(range(12))
    # copy_first's problems and reward, unchanged
    copy = build_task(TaskSpec(name="copy_first"), tiny_tokenizer)
    expected = list(itertools.islice(copy.train_prompts(seed=3), 12))
    assert [(p.text, p.label) for p in prompts] == [(p.text, p.label) for p in expected]
    right = prompts[0].label_token_ids
    assert task.reward(prompts[0], right, prompts[0].label) == 1.0
    assert all(RESPONSE_BUDGET_KEY not in p.metadata for p in task.eval_prompts(4))


@pytest.mark.parametrize("words", [1, 7, 130], ids=["one-word", "short", "wraps-past-the-context-words"])
def test_context_precedes_every_problem(words: int, tiny_tokenizer: Any) -> None:
    """The same context of `words` tokens before each training and evaluation problem; the problem, its label
    and its budget are copy_first's and the schedule's, unchanged."""
    plain = _drift(tiny_tokenizer)
    task = _drift(tiny_tokenizer, context_tokens=words)
    for with_context, without in zip([*itertools.islice(task.train_prompts(seed=2), 6), *task.eval_prompts(3)],
                                     [*itertools.islice(plain.train_prompts(seed=2), 6), *plain.eval_prompts(3)],
                                     strict=True):
        context, _, problem = with_context.text.partition(" : ")
        assert problem == without.text and with_context.label == without.label
        assert with_context.metadata == without.metadata
        assert len(context.split()) == words and set(context.split()) <= {str(100 + i) for i in range(100)}
        assert len(with_context.token_ids) == len(without.token_ids) + words + 1  # every word one token
        assert with_context.token_ids[-len(without.token_ids):] == without.token_ids
    contexts = {p.text.partition(" : ")[0] for p in itertools.islice(task.train_prompts(seed=5), 20)}
    assert len(contexts) == 1, "one shared context (a prefix the rollout's cache can share)"


def test_resumed_stream_continues_the_budgets(tiny_tokenizer: Any) -> None:
    """A resumed job slices the same seeded stream after the prompts already drawn (as `RLLoop` does)."""
    fresh = list(itertools.islice(_drift(tiny_tokenizer).train_prompts(seed=1), 10))
    resumed = list(itertools.islice(_drift(tiny_tokenizer).train_prompts(seed=1), 5, 10))
    assert [p.metadata for p in resumed] == [p.metadata for p in fresh[5:]]


@pytest.mark.parametrize(("params", "field"), [
    ({"start_tokens": 0}, "task.params.start_tokens"),
    ({"end_tokens": 2}, "task.params.end_tokens"),
    ({"ramp_prompts": 0}, "task.params.ramp_prompts"),
    ({"end_tokens": 2.5}, "task.params.end_tokens"),
    ({"context_tokens": -1}, "task.params.context_tokens"),
    ({"context_tokens": 1.5}, "task.params.context_tokens"),
], ids=["start-zero", "shrinking", "no-ramp", "float", "negative-context", "float-context"])
def test_bad_schedule_params(params: dict[str, Any], field: str, tiny_tokenizer: Any) -> None:
    with pytest.raises(TaskError) as info:
        _drift(tiny_tokenizer, **params)
    assert info.value.field == field and info.value.fix


@pytest.mark.parametrize(("metadata", "cap", "budget"), [
    ({}, 16, 16),
    ({RESPONSE_BUDGET_KEY: 4}, 16, 4),
    ({RESPONSE_BUDGET_KEY: 40}, 16, 16),
    ({RESPONSE_BUDGET_KEY: 0}, 16, 1),
], ids=["no-budget", "smaller", "capped-by-max-new-tokens", "at-least-one"])
def test_response_budget(metadata: dict[str, int], cap: int, budget: int) -> None:
    assert response_budget(Prompt("t", [1], "l", [2], metadata), cap) == budget


@dataclass
class _Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


def test_producer_asks_for_each_prompts_budget(tiny_tokenizer: Any, tmp_path: Path) -> None:
    asked: list[int] = []

    async def generate(prompt_ids: Sequence[int], n: int, max_new_tokens: int, **_: Any) -> list[_Completion]:
        asked.append(max_new_tokens)
        return [_Completion([1] * max_new_tokens, [-1.0] * max_new_tokens, "length", 0) for _ in range(n)]

    buffer = SampleBuffer(8, 2, 0, 2)  # one group in flight at a time: the budgets are asked in stream order
    producer = RolloutProducer(generate, _drift(tiny_tokenizer, end_tokens=12).train_prompts(seed=0),
                               lambda p, r: 0.0, buffer, SamplingSettings(n_samples=2, max_new_tokens=10),
                               EventLog(tmp_path / "events.jsonl"))
    producer.start()
    try:
        batch, _ = buffer.collect(0, timeout_s=10, max_retries=0)
    finally:
        producer.stop()
    lengths = [len(r) for g in sorted(batch, key=lambda g: g.index) for r in g.responses]
    assert asked[:8] == [4, 5, 6, 7, 8, 9, 10, 10]  # 4 + i rising to 12, capped by max_new_tokens 10
    assert lengths == sorted(lengths) and lengths[0] == 4 and lengths[-1] == 10
