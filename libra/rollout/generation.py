"""Generation: request checks, the completion payload and its parsing, in-flight task tracking and the
pool-wide abort at a step boundary. Requests go through the `Router`, which picks the serving instance.

Every completion records the weight version of the instance that produced it: a reload first waits for the
instance's requests in flight (the publisher), so no request is answered by a mix of versions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from libra.rollout.router import DRAINING, READY, Router
from libra.rollout.spec import Completion, GenerationAborted, PoolStats, RolloutError, RolloutPoolSpec

ABORT_WAIT_S = 30.0
SAMPLING_OPTIONS = ("temperature", "top_p", "seed")


def check_request(
    spec: RolloutPoolSpec,
    prompt: Sequence[int],
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
) -> None:
    """Raise ValueError listing every problem of one generation request."""
    problems = []
    if not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
        problems.append("prompt_ids must be a non-empty list of token ids >= 0")
    if n < 1:
        problems.append(f"n={n}: must be >= 1")
    if max_new_tokens < 1:
        problems.append(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if len(prompt) + max_new_tokens > spec.max_model_len:
        problems.append(
            f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds "
            f"max_model_len={spec.max_model_len}; shorten the prompt or raise max_model_len"
        )
    if temperature < 0:
        problems.append(f"temperature={temperature}: must be >= 0")
    if not 0 < top_p <= 1:
        problems.append(f"top_p={top_p}: must be in (0, 1]")
    if problems:
        raise ValueError("invalid generation request: " + "; ".join(problems))


def check_sampling_options(sampling: dict[str, Any]) -> None:
    unknown = set(sampling) - set(SAMPLING_OPTIONS)
    if unknown:
        raise TypeError(
            f"generate_batch got unknown sampling options {sorted(unknown)}; use {', '.join(SAMPLING_OPTIONS)}"
        )


def completion_payload(
    spec: RolloutPoolSpec, prompt: list[int], n: int, max_new_tokens: int, temperature: float, top_p: float,
    seed: int | None,
) -> dict[str, Any]:  # fmt: skip
    # vLLM refuses n > 1 for greedy sampling; greedy samples are identical, so one is sampled and copied.
    payload: dict[str, Any] = {
        "model": spec.served_model_name,
        "prompt": prompt,
        "n": 1 if temperature == 0.0 else n,
        "max_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    if seed is not None:
        payload["seed"] = seed
    return payload


def parse_completions(
    response: dict[str, Any], prompt: list[int], n: int, greedy: bool, instance_id: str, version: int
) -> list[Completion]:
    """The n completions of one response, each tagged with the instance and weight version that made it."""
    choices = response.get("choices")
    if not isinstance(choices, list):
        raise RolloutError(f"completion response without choices: {str(response)[:300]}")
    completions = [
        _completion(prompt, choice, instance_id, version)
        for choice in sorted(choices, key=lambda c: int(c.get("index", 0)))
    ]
    if greedy and completions:
        first = completions[0]
        completions = [
            replace(
                first, prompt_ids=list(prompt), token_ids=list(first.token_ids), logprobs=list(first.logprobs)
            )
            for _ in range(n)
        ]
    if len(completions) != n:
        raise RolloutError(f"{instance_id} returned {len(completions)} completions, {n} were asked for")
    return completions


def _completion(prompt: list[int], choice: dict[str, Any], instance_id: str, version: int) -> Completion:
    token_ids = [int(t) for t in choice.get("token_ids") or []]
    logprobs_block = choice.get("logprobs") or {}
    logprobs = [
        float(x) if x is not None else float("nan") for x in logprobs_block.get("token_logprobs") or []
    ]
    if len(logprobs) != len(token_ids):
        raise RolloutError(
            f"{instance_id} returned {len(token_ids)} token ids but {len(logprobs)} log-probs; "
            "the server must support return_token_ids with logprobs"
        )
    return Completion(
        prompt, token_ids, logprobs, str(choice.get("finish_reason") or ""), instance_id, version
    )


class Generation:
    """Runs generation requests on the pool's loop and tracks them, so `abort_all` can end every one."""

    def __init__(self, spec: RolloutPoolSpec, router: Router) -> None:
        self.spec = spec
        self.router = router
        self.abort_epoch = 0
        self._tasks: set[asyncio.Task[Any]] = set()

    async def generate_batch(
        self, prompts: list[list[int]], n: int, max_new_tokens: int, sampling: dict[str, Any], epoch: int
    ) -> list[list[Completion]]:
        results = await asyncio.gather(
            *(
                self.generate(
                    list(p), n, max_new_tokens, sampling.get("temperature", 1.0), sampling.get("top_p", 1.0),
                    sampling.get("seed"), epoch,
                )
                for p in prompts
            ),
            return_exceptions=True,
        )  # fmt: skip
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if not isinstance(r, BaseException)]

    async def generate(
        self, prompt: list[int], n: int, max_new_tokens: int, temperature: float, top_p: float,
        seed: int | None, epoch: int,
    ) -> list[Completion]:  # fmt: skip
        """n completions of one prompt from one instance; `epoch` is the abort epoch when it was submitted."""
        if epoch != self.abort_epoch:  # submitted before an abort_all that ran before this task did
            raise GenerationAborted("generation aborted at a step boundary (abort_all) or by shutdown")
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        payload = completion_payload(self.spec, prompt, n, max_new_tokens, temperature, top_p, seed)
        try:
            response, slot, version = await self.router.send(payload)
        except asyncio.CancelledError:
            if epoch == self.abort_epoch:
                # Cancelled by its caller, not by abort_all: stay cancelled. An exception here would end a
                # task whose waiter is gone, which asyncio reports as "Task exception was never retrieved".
                raise
            raise GenerationAborted(
                "generation aborted at a step boundary (abort_all) or by shutdown"
            ) from None
        finally:
            self._tasks.discard(task)
        completions = parse_completions(response, prompt, n, temperature == 0.0, slot.id, version)
        self.router.tokens += sum(len(c.token_ids) for c in completions)
        return completions

    async def abort_all(self, notify_servers: bool) -> None:
        """Abort every in-flight and queued request; their callers get GenerationAborted."""
        self.abort_epoch += 1
        for task in list(self._tasks):
            task.cancel()
        if notify_servers:
            await asyncio.gather(
                *(
                    s.client.abort_requests()
                    for s in self.router.slots.values()
                    if s.state in (READY, DRAINING)
                ),
                return_exceptions=True,
            )
        deadline = time.monotonic() + ABORT_WAIT_S
        while self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def stats(self) -> PoolStats:
        router = self.router
        busy = router.busy_seconds()
        return PoolStats(
            tokens_generated=router.tokens,
            tokens_per_s=router.tokens / busy if busy > 0 else 0.0,
            busy_s=busy,
            requests_completed=router.completed,
            requests_failed=router.failed,
            retries=router.retries,
            in_flight=router.in_flight,
            queue_depth=router.waiting,
            requests_aborted=router.aborted,
            outstanding_by_instance={
                s.id: s.outstanding for s in sorted(router.slots.values(), key=lambda s: s.id)
            },
        )
