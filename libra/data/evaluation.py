"""Periodic evaluation on held-out prompts: score what a generate function answers with the task's reward."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from libra.data.prompt import Prompt
from libra.data.registry import Task

Generated = tuple[Sequence[int], str]
GenerateFn = Callable[[list[Prompt]], Sequence[Generated]]


def evaluate(generate_fn: GenerateFn, task: Task, n: int = 0, correct_at: float = 1.0) -> dict[str, float]:
    """Generate one response per held-out prompt (up to `n`; all when n <= 0) and score it.

    `generate_fn(prompts)` returns one `(response_token_ids, response_text)` per prompt, in order.
    Returns `accuracy` (share of rewards >= `correct_at`), `reward_mean` and `num_prompts`.
    """
    prompts = task.eval_prompts(n)
    if not prompts:
        return {"accuracy": 0.0, "reward_mean": 0.0, "num_prompts": 0.0}
    responses = list(generate_fn(prompts))
    if len(responses) != len(prompts):
        raise ValueError(f"generate_fn returned {len(responses)} responses for {len(prompts)} prompts")
    rewards = [task.reward(p, ids, text) for p, (ids, text) in zip(prompts, responses, strict=True)]
    return {
        "accuracy": sum(r >= correct_at for r in rewards) / len(rewards),
        "reward_mean": sum(rewards) / len(rewards),
        "num_prompts": float(len(prompts)),
    }
