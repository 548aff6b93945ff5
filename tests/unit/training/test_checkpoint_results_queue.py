"""The in-process queue through which Megatron-Core's checkpoint writer hands back its write results: created
when missing, and emptied at the start of every save, so a result an earlier failed save left is never read as
the next save's (the writer reads the oldest result)."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import pytest
from megatron.core.dist_checkpointing.strategies import filesystem_async

from libra.training.checkpoint import use_in_process_results_queue


@pytest.fixture
def module_queue() -> Iterator[None]:
    kept = filesystem_async._results_queue
    yield
    filesystem_async._results_queue = kept


def test_a_missing_queue_is_created_in_process(module_queue: None) -> None:
    filesystem_async._results_queue = None
    assert use_in_process_results_queue() == 0
    assert isinstance(filesystem_async._results_queue, queue.Queue)


@pytest.mark.parametrize("stale", [0, 1, 3], ids=["none-left", "one-left", "three-left"])
def test_results_an_earlier_save_left_are_dropped(module_queue: None, stale: int) -> None:
    results: queue.Queue[object] = queue.Queue()
    for index in range(stale):
        results.put({index: ["write result of an earlier save"]})
    filesystem_async._results_queue = results
    assert use_in_process_results_queue() == stale
    assert filesystem_async._results_queue is results and results.empty()
    results.put({0: ["this save's result"]})
    assert results.get_nowait() == {0: ["this save's result"]}
