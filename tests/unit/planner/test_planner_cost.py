"""Cost model: compute scaling, where communication lands, pipeline bubble, decode roofline, step time."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from planner_cases import inputs

from planner.cost import (
    decode_step_s,
    forward_flops_per_token,
    linear_params,
    rollout_costs,
    step_seconds,
    synchronous_decode_s,
    train_costs,
)
from planner.layout import TrainLayout
from planner.sim.decode import decode_steps, drain_batch


def test_forward_flops_count_matmuls_and_causal_attention() -> None:
    inp = inputs()
    spec = inp.model
    flops = forward_flops_per_token(spec, 1000.0)
    attention = 2 * spec.num_layers * spec.num_attention_heads * spec.head_dim * 1000.0
    assert flops == pytest.approx(2 * linear_params(spec) + attention)
    assert linear_params(spec) == spec.total_params - spec.embedding_params


def test_compute_time_halves_when_data_parallel_doubles() -> None:
    costs = train_costs(inputs(), TrainLayout(), np.array([1, 2, 4]))
    assert costs["compute_s"][0] == pytest.approx(2 * costs["compute_s"][1])
    assert costs["compute_s"][1] == pytest.approx(2 * costs["compute_s"][2])


def test_tp_communication_is_zero_at_tp1_and_grows_across_nodes() -> None:
    inp = inputs(nodes=2, gpus_per_node=4)
    assert train_costs(inp, TrainLayout(tp=1), 2)["tp_comm_s"] == 0.0
    assert train_costs(inp, TrainLayout(tp=4), 2)["tp_comm_ratio"] > 0.0


def test_expert_all_to_all_is_slower_when_the_ep_group_spans_nodes() -> None:
    inp = inputs("qwen3-30b-a3b", nodes=4)
    inside = train_costs(inp, TrainLayout(tp=1, ep=8), 8)  # EP group = 8 GPUs of one node
    across = train_costs(inp, TrainLayout(tp=2, ep=8), 4)  # EP group spans 16 GPUs = 2 nodes
    assert across["ep_comm_ratio"] > 3 * inside["ep_comm_ratio"] > 0


def test_data_parallel_gradients_cross_nodes_beyond_one_node() -> None:
    inp = inputs(nodes=4)
    inside = train_costs(inp, TrainLayout(), 8)["dp_comm_s"]
    across = train_costs(inp, TrainLayout(), 16)["dp_comm_s"]
    assert across > 5 * inside


@pytest.mark.parametrize(("pp", "vpp", "dp"), [(2, 1, 1), (4, 1, 2), (4, 2, 2), (8, 1, 4)])
def test_bubble_is_p_minus_1_over_v_m(pp: int, vpp: int, dp: int) -> None:
    inp = inputs(train_micro_batch_size=2, vpp=vpp)
    microbatches = inp.workload.samples_per_step // (dp * 2)
    costs = train_costs(inp, TrainLayout(pp=pp, vpp=vpp), dp)
    assert costs["bubble_ratio"] == pytest.approx((pp - 1) / (vpp * microbatches))


def test_full_recompute_costs_an_extra_forward() -> None:
    none = train_costs(inputs(), TrainLayout(), 4)["compute_s"]
    full = train_costs(inputs(recompute_granularity="full"), TrainLayout(), 4)["compute_s"]
    assert full == pytest.approx(none * 4 / 3)


def test_decode_is_memory_bound_at_small_batch_and_amortises_weights() -> None:
    inp = inputs()
    one, many = decode_step_s(inp, 1, 1), decode_step_s(inp, 1, 64)
    weights_time = inp.model.total_params * 2 / (inp.cluster.gpu.hbm_bytes_per_s * inp.cost.hbm_efficiency)
    assert one >= weights_time
    assert 64 / many > 20 / one  # batching raises tokens/s many times


def test_rollout_generation_uses_the_kv_bound_batch() -> None:
    inp = inputs(max_concurrent_rollouts=1000)
    small = rollout_costs(inp, 1, 4, kv_capacity=8)
    large = rollout_costs(inp, 1, 4, kv_capacity=200)
    assert small["batch_per_instance"] == 8
    assert large["tokens_per_s"] > small["tokens_per_s"]


def test_sync_generation_waits_for_the_longest_response() -> None:
    inp = inputs(max_new_tokens=2048, expected_response_tokens=64)
    sync = rollout_costs(inp, 1, 64, kv_capacity=200)["generation_s"]
    asyn = rollout_costs(replace(inp, workload=replace(inp.workload, max_head_offpolicyness=1)), 1, 64, 200)
    assert sync >= 2048 * decode_step_s(inp, 1, 1)
    assert asyn["generation_s"] < sync


# (max_head_offpolicyness, training side, rollout side, weight-version chain's rollout part, step seconds)
STEPS = [
    ("synchronous: one after the other", 0, 3.0, 5.0, 0.0, 8.0),
    ("synchronous: the chain is the step already", 0, 3.0, 5.0, 20.0, 8.0),
    ("async, rollout side sets the step", 2, 3.0, 5.0, 0.0, 5.0),
    ("async, training side sets the step", 2, 7.0, 5.0, 0.0, 7.0),
    ("async, a short chain changes nothing", 2, 3.0, 5.0, 9.0, 5.0),
    ("async lag 2: the chain over 3 steps", 2, 3.0, 5.0, 21.0, 8.0),
    ("async lag 1: the chain over 2 steps", 1, 3.0, 5.0, 21.0, 12.0),
]


@pytest.mark.parametrize(("lag", "train", "rollout", "chain", "step"), [c[1:] for c in STEPS],
                         ids=[c[0] for c in STEPS])
def test_step_time(lag: int, train: float, rollout: float, chain: float, step: float) -> None:
    assert float(step_seconds(inputs(max_head_offpolicyness=lag), train, rollout, chain)) == pytest.approx(step)


@pytest.mark.parametrize(("lag", "tail_batch"), [
    pytest.param(1, "full", id="async: the admission window keeps the slots full beside the longest response"),
    pytest.param(0, "alone", id="synchronous: the batch drains down to the longest response alone"),
])
def test_the_longest_response_decodes_beside_the_batch_it_runs_with(lag: int, tail_batch: str) -> None:
    inp = inputs(max_new_tokens=2048, expected_response_tokens=64, max_head_offpolicyness=lag)
    costs = rollout_costs(inp, 1, 64, kv_capacity=200)
    batch = int(costs["batch_per_instance"])
    assert batch > 1
    per_token = decode_step_s(inp, 1, batch if tail_batch == "full" else 1)
    assert float(costs["batch_latency_s"]) == pytest.approx(2048 * per_token, rel=0.01)
    assert decode_step_s(inp, 1, batch) > decode_step_s(inp, 1, 1)  # the two cases differ


# (case, batch_size x n_samples per step, instances, KV slots, expected response tokens of max_new_tokens 2048)
SYNCHRONOUS = [
    ("more requests than slots: bulk, then the drain", 64, 2, 16, 600),
    ("one instance, a short mean: a long drain", 64, 1, 32, 100),
    ("every request starts at once: the longest alone", 16, 2, 64, 600),
    ("the mean near max_new_tokens: the drain is short", 64, 2, 16, 1900),
]


@pytest.mark.parametrize(("samples", "instances", "slots", "mean"), [c[1:] for c in SYNCHRONOUS],
                         ids=[c[0] for c in SYNCHRONOUS])
def test_a_synchronous_batch_decodes_as_the_simulator_aggregates_it(
        samples: int, instances: int, slots: int, mean: int) -> None:
    """`synchronous_decode_s` is the simulator's per-instance aggregate (`planner.sim.decode`) on the planner's
    lengths: the longest response at max_new_tokens, a running response's mean residual length the mean."""
    inp = inputs(batch_size=samples // 8, n_samples=8, expected_response_tokens=mean)
    requests, tokens = samples / instances, samples / instances * mean
    count = min(slots, int(requests))
    bulk, drain = decode_steps(int(requests), tokens, 2048, 2.0 * mean, count)
    batch = drain_batch(tokens, count, bulk, drain)
    expected = bulk * decode_step_s(inp, 1, count) + drain * decode_step_s(inp, 1, batch)
    assert float(synchronous_decode_s(inp, 1, instances, slots)) == pytest.approx(expected, rel=1e-9)
    full_batch_only = tokens * decode_step_s(inp, 1, count) / count  # what the model took before
    assert float(synchronous_decode_s(inp, 1, instances, slots)) > full_batch_only


def test_a_synchronous_generation_includes_its_drain_and_a_job_measures_the_rate_over_it() -> None:
    inp = inputs(batch_size=8, n_samples=8, expected_response_tokens=600)
    costs = rollout_costs(inp, 1, 2, kv_capacity=16)
    decode = float(synchronous_decode_s(inp, 1, 2, int(costs["batch_per_instance"])))
    assert float(costs["generation_s"]) >= decode
    assert float(costs["generation_tokens_per_s"]) == pytest.approx(64 * 600 / float(costs["generation_s"]))
    assert float(costs["generation_tokens_per_s"]) < float(costs["tokens_per_s"])  # the drain's slots idle


def test_a_batch_latency_is_its_longest_response_when_that_outlasts_its_generation() -> None:
    inp = inputs(max_new_tokens=2048, expected_response_tokens=64, max_head_offpolicyness=1)
    costs = rollout_costs(inp, 1, 64, kv_capacity=200)
    assert costs["batch_latency_s"] >= 2048 * decode_step_s(inp, 1, 1) > costs["generation_s"]
    near_max = inputs(max_new_tokens=256, expected_response_tokens=200, max_head_offpolicyness=1)
    one = rollout_costs(near_max, 1, 1, kv_capacity=200)  # one instance generates the whole batch: longer
    assert one["batch_latency_s"] == one["generation_s"] > 256 * decode_step_s(near_max, 1, 1)


def test_speed_factors_scale_the_predictions() -> None:
    inp = inputs()
    fast = replace(inp, cost=replace(inp.cost, rollout_speed_factor=2.0))
    assert decode_step_s(fast, 1, 16) == pytest.approx(decode_step_s(inp, 1, 16) / 2)
