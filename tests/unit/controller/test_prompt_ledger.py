"""The prompt ledger: which prompts are done whatever order their groups finished in, so that a resume draws
each prompt not done once and none that was; and the producer resumed from it."""

from __future__ import annotations

import asyncio
from itertools import count, islice
from pathlib import Path

import pytest

from libra.controller.batching import SampleBuffer
from libra.controller.events import EventLog
from libra.controller.producer import RolloutProducer, SamplingSettings
from libra.controller.prompt_ledger import PromptLedger

from .test_batching import FakeCompletion, P


@pytest.mark.parametrize(("batches", "position", "ahead"), [
    pytest.param([[0, 1, 2, 3]], 4, set(), id="in-order"),
    pytest.param([[0, 1, 2, 4, 5]], 3, {4, 5}, id="out-of-order-leaves-a-gap"),
    pytest.param([[0, 1, 2, 4, 5], [3, 7]], 6, {7}, id="the-gap-filled-later"),
    pytest.param([[1, 2], [0]], 3, set(), id="the-first-prompt-last"),
    pytest.param([[0, 1], [1, 0]], 2, set(), id="done-twice-counts-once"),
    pytest.param([[5, 6]], 0, {5, 6}, id="a-prompt-waiting-for-a-retry-holds-the-position"),
    pytest.param([], 0, set(), id="nothing-done"),
])
def test_the_position_is_the_first_prompt_not_done(batches: list[list[int]], position: int, ahead: set[int]) -> None:
    ledger = PromptLedger()
    for batch in batches:
        ledger.done(batch)
    assert (ledger.position, ledger.done_ahead) == (position, ahead)


@pytest.mark.parametrize(("position", "ahead"), [
    pytest.param(-1, set(), id="negative-position"),
    pytest.param(4, {2}, id="done-ahead-below-the-position"),
])
def test_an_impossible_ledger_is_refused(position: int, ahead: set[int]) -> None:
    with pytest.raises(ValueError, match=f"position {position}"):
        PromptLedger(position, ahead)


def test_a_ledger_made_from_a_checkpoint_moves_past_what_it_holds() -> None:
    assert (PromptLedger(3, {3, 4, 6}).position, PromptLedger(3, {3, 4, 6}).done_ahead) == (5, {6})


def test_a_resumed_producer_draws_every_prompt_not_done_once_and_none_that_was(tmp_path: Path) -> None:
    """Groups 0, 1, 2, 4 and 5 were trained before the checkpoint; 3 was generating and 6 waiting for a retry.
    The producer made from the ledger draws 3, 6, 7, ... with their own indices (their seeds) and prompts."""
    ledger = PromptLedger()
    ledger.done([0, 1, 2, 4, 5])
    drawn: list[tuple[int, int]] = []  # (seed, the prompt's own number)

    async def generate(prompt_ids: list[int], seed: int, **kw: object) -> list[FakeCompletion]:
        drawn.append((seed, prompt_ids[0]))
        await asyncio.sleep(0)
        return [FakeCompletion([1], [-1.0], "stop", 0)]

    stream = (P([i]) for i in count())
    buffer = SampleBuffer(batch_size=4, group_size=1, max_offpolicyness=0, max_concurrent_samples=1)
    producer = RolloutProducer(generate, islice(stream, ledger.position, None), lambda p, r: 1.0, buffer,
                               SamplingSettings(n_samples=1, max_new_tokens=1), EventLog(tmp_path / "e.jsonl"),
                               prompts_drawn=ledger.position, skip=ledger.done_ahead, poll_s=0.01)
    producer.start()
    try:
        groups, _ = buffer.collect(0, timeout_s=10, max_retries=0)
    finally:
        producer.stop()
    assert [g.index for g in groups] == [3, 6, 7, 8]
    assert drawn == [(3, 3), (6, 6), (7, 7), (8, 8)]
