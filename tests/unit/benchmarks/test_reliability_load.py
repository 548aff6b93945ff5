"""The load fault's pure parts: what counts as flat memory, and the queue drain through the job's real
producer and buffer accounting for every prompt it drew, within the concurrency bound."""

from __future__ import annotations

import pytest
from benchmark_modules import load_benchmark_module

load = load_benchmark_module("reliability_load")


@pytest.mark.parametrize(("samples", "growth"), [
    pytest.param([100.0] * 8, 0.0, id="flat"),
    pytest.param([90.0, 95.0, 100.0, 100.0, 100.0, 100.0, 110.0, 110.0], 0.1, id="warm-up-ignored-then-growth"),
    pytest.param([50.0, 200.0, 100.0, 100.0, 101.0, 99.0, 100.0, 100.0], 0.0, id="noise-around-a-level"),
    pytest.param([100.0] * 7, None, id="too-few-samples"),
])
def test_rss_growth_compares_the_last_quarter_with_the_settled_second(samples: list[float],
                                                                     growth: float | None) -> None:
    assert load.rss_growth(samples) == growth


def test_queue_drain_accounts_for_every_prompt_drawn_within_the_bound() -> None:
    result = load.queue_load(prompts=1000, server="stand-in")  # no vLLM server in unit tests
    assert result["lost"] == 0 and result["duplicated"] == 0
    assert result["groups_trained"] == (1000 // load.BATCH_SIZE) * load.BATCH_SIZE
    assert result["prompts_drawn"] == result["groups_trained"] + result["left_buffered"] + result["left_to_retry"] \
        + result["cancelled_in_flight"]
    assert 0 < result["max_in_flight_seen"] <= load.MAX_CONCURRENT_ROLLOUTS and result["within_bound"]


def test_queue_load_refuses_an_unknown_server() -> None:
    with pytest.raises(ValueError, match="server='sglang'"):
        load.queue_load(prompts=10, server="sglang")


@pytest.mark.parametrize(("details", "met"), [
    pytest.param({}, True, id="no-memory-figure"),
    pytest.param({"memory_flat": True}, True, id="flat"),
    pytest.param({"memory_flat": False}, False, id="grew"),
])
def test_a_load_fault_meets_its_target_only_with_flat_memory(details: dict[str, bool], met: bool) -> None:
    accounting = load_benchmark_module("reliability_accounting")
    fault = {"survived": True, "samples_lost": 0, "samples_duplicated": 0, "steps_repeated": 0, "details": details}
    assert accounting.target_met(fault) is met
