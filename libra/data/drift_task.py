"""The built-in drifting workload `drift`: a task whose responses grow longer as training goes on, as they do
in reasoning RL, so that the best split of GPUs moves from training-heavy to rollout-heavy within one job.

The tiny development models write random text, so the growth cannot come from what the policy learns. It is
imposed by the task, honestly and visibly: the k-th prompt of the training stream carries a response budget
(`Prompt.metadata["max_new_tokens"]`, see `libra.data.prompt.response_budget`) that rises linearly from
`start_tokens` to `end_tokens` over the first `ramp_prompts` prompts and then stays there (the curve family
`planner.sim.lengths.DriftCurve`, which the simulator's drifting workload follows too, so a simulated run can
be calibrated against a real one); the rollout producer asks the rollout pool for that many tokens (never
more than the job's `max_new_tokens`). A model
that rarely samples its end-of-sequence token fills the budget, so the rollout's decode steps, the trained
tokens and the log-prob recomputation all grow with it. The prompts, answers and reward are `copy_first`'s
(only the response's first token is scored), so the policy still has something to learn.

`context_tokens` puts the same context of that many words before every problem ("100 101 ... : 7 3 9 ?"), as a
shared system prompt or few-shot preamble does: training pays for every context token of every sample, the
rollout only for one prefill of it per request (and vLLM's prefix cache shares it between requests). With a
long context and short answers at the start, training dominates a step; as the answers grow, decoding them
comes to dominate it, which moves the best split further than the growth of the answers alone.

The stream is numbered from the job's first prompt: a resumed job skips the prompts already drawn
(`RLLoop` slices the same seeded stream), so its budgets continue where they stopped. With `batch_size` B
prompts per step, the ramp spans `ramp_prompts / B` steps. Evaluation prompts carry no budget (they are
answered with the job's `max_new_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from libra.data.builtin_tasks import CopyFirst
from libra.data.prompt import RESPONSE_BUDGET_KEY, Encode, ParamValue, Prompt, TaskError
from libra.data.registry import TaskSpec, register_task
from planner.sim.lengths import DriftCurve

DRIFT_PARAMS: dict[str, ParamValue] = {"start_tokens": 8, "end_tokens": 64, "ramp_prompts": 1024, "context_tokens": 0}
CONTEXT_WORDS = 100  # the shared context cycles through the number words 100..199 of the tiny vocabulary


@dataclass(frozen=True)
class LengthSchedule:
    """Response budget of the k-th prompt: `start` rising linearly to `end` over `ramp` prompts."""

    start: int
    end: int
    ramp: int

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> LengthSchedule:
        start, end, ramp = int(params["start_tokens"]), int(params["end_tokens"]), int(params["ramp_prompts"])
        for key, value in (("start_tokens", start), ("ramp_prompts", ramp)):
            if value < 1:
                raise TaskError(f"{value} must be at least 1", field=f"task.params.{key}", value=value,
                                fix="set it to 1 or more")
        if end < start:
            raise TaskError(f"{end} is below start_tokens ({start}): the responses would shrink, not grow",
                            field="task.params.end_tokens", value=end, fix=f"set it to {start} or more")
        return cls(start, end, ramp)

    def budget(self, prompt_index: int) -> int:
        return round(DriftCurve(self.start, self.end, self.ramp).at(prompt_index))


@register_task("drift")
class Drift(CopyFirst):
    """`copy_first` prompts ("7 3 9 ?" -> 7) with a response budget that grows over the training stream."""

    name = "drift"
    PARAMS: ClassVar[dict[str, ParamValue]] = {**CopyFirst.PARAMS, **DRIFT_PARAMS}

    def __init__(self, spec: TaskSpec, encode: Encode) -> None:
        super().__init__(spec, encode)
        self.schedule = LengthSchedule.from_params(self.params)
        words = int(self.params["context_tokens"])
        if words < 0:
            raise TaskError(f"{words} is negative", field="task.params.context_tokens", value=words,
                            fix="set it to 0 (no context) or more")
        self.context = " ".join(str(CONTEXT_WORDS + i % CONTEXT_WORDS) for i in range(words))

    def problem(self, index: int) -> tuple[str, str, dict[str, Any]]:
        text, label, metadata = super().problem(index)
        return (f"{self.context} : {text}" if self.context else text), label, metadata

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        for index, prompt in enumerate(super().train_prompts(seed)):
            budget = {RESPONSE_BUDGET_KEY: self.schedule.budget(index), "stream_index": index}
            yield Prompt(prompt.text, prompt.token_ids, prompt.label, prompt.label_token_ids,
                         {**prompt.metadata, **budget})
