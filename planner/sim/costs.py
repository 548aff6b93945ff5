"""Phase times of the simulated job, from the planner's cost and memory models, cached.

- Decode step of one rollout instance (`planner.cost.decode_step_s`, roofline: weights and the running
  batch's KV cache read from HBM, or compute, plus TP all-reduces and a fixed overhead) at the batch's live
  context; slots from the KV-cache budget (`planner.memory.kv_capacity_sequences` x max_model_len tokens)
  and vLLM's cap (`planner.memory.max_batch`, max_num_seqs 256).
- Prefill (the cost model's formula: the n samples of a prompt group share the prompt through the prefix
  cache).
- Training side of one step (`planner.cost.train_costs`: training + log-prob recomputation) for a layout
  and a data-parallel size at the step's actual mean response length.
- Weight sync per reload method (`planner.cost.rollout_costs`: reload + weight transfer over the network)
  and reload strategy: `parallel` stops every instance for one reload; `serial` reloads node by node, so
  each node is down for one reload (the same GPU-seconds) and the new version is everywhere only after
  nodes x one reload.
- Switch costs: `CostParams.rollout_restart_s` (an instance from start to ready) and `train_restart_s` (the
  training pool re-formed at a new size, checkpoint reload included), the planner's own constants; the
  strategies' effects are `SWITCH_EFFECTS` in `planner.sim.engine`.

With `MeasuredCosts` (constants fitted to measured runs, `planner.sim.fit`) the decode step, prefill, training
side and weight sync come from those constants instead of the cost model; slots and switch costs do not
change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from planner.cost import decode_step_s, forward_flops_per_token, rollout_costs, train_costs
from planner.layout import TrainLayout
from planner.memory import kv_capacity_sequences, max_batch
from planner.workload import PlannerInputs

ReloadMethod = Literal["restart", "inplace"]
ReloadStrategy = Literal["parallel", "serial"]
LENGTH_BUCKET = 16  # tokens: mean lengths are rounded to this for the caches (well below the cost model's precision)


@dataclass(frozen=True)
class MeasuredCosts:
    """Phase-time constants of one job on one kind of hardware, fitted to measured runs:

    - a decode step of one instance running n sequences takes `decode_fixed_s + decode_per_seq_s x n`
      (the running batch's work plus what a step costs whatever its batch: scheduling, sampling, the engine's
      own loop); prefill and the per-batch dispatch are folded into `decode_fixed_s`;
    - the training side of a step (training and log-prob recomputation) on `dp` data-parallel replicas takes
      `train_step_s + train_token_s x tokens / dp`, tokens = the step's samples x (prompt + mean response);
    - a weight sync stops the rollout pool for `sync_s`.
    """

    decode_fixed_s: float
    decode_per_seq_s: float
    train_step_s: float
    train_token_s: float
    sync_s: float

    def __post_init__(self) -> None:
        bad = [f"{name}: {value!r}" for name, value in self.as_dict().items()
               if not (math.isfinite(value) and value >= 0)]
        if bad:
            raise ValueError(f"measured costs must be finite and >= 0: {', '.join(bad)}")

    def as_dict(self) -> dict[str, float]:
        return {"decode_fixed_s": self.decode_fixed_s, "decode_per_seq_s": self.decode_per_seq_s,
                "train_step_s": self.train_step_s, "train_token_s": self.train_token_s, "sync_s": self.sync_s}


@dataclass
class PhaseCosts:
    """Cached phase times for one job's planner inputs (`inputs` already carries the reload method)."""

    inputs: PlannerInputs
    reload_strategy: ReloadStrategy = "parallel"
    measured: MeasuredCosts | None = None
    _decode: dict[tuple[int, int, int], float] = field(default_factory=dict)
    _train: dict[tuple[TrainLayout, int, int], float] = field(default_factory=dict)
    _kv: dict[int, int] = field(default_factory=dict)
    _sync: dict[int, float] = field(default_factory=dict)
    _with_length: dict[int, PlannerInputs] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> float:
        return self.inputs.workload.prompt_tokens

    @property
    def max_seqs(self) -> int:
        return max_batch(self.inputs)

    def with_response(self, tokens: float) -> PlannerInputs:
        """The inputs with `expected_response_tokens` set to `tokens` (bucketed)."""
        bucket = max(1, int(round(tokens / LENGTH_BUCKET)))
        found = self._with_length.get(bucket)
        if found is None:
            w = self.inputs.workload
            found = replace(self.inputs, workload=replace(
                w, expected_response_tokens=min(w.max_new_tokens, bucket * LENGTH_BUCKET),
                expected_prompt_tokens=int(round(w.prompt_tokens))))
            self._with_length[bucket] = found
        return found

    def kv_tokens(self, rollout_tp: int) -> int:
        """KV-cache token budget of one instance."""
        if rollout_tp not in self._kv:
            self._kv[rollout_tp] = kv_capacity_sequences(self.inputs, rollout_tp) * self.inputs.workload.max_model_len
        return self._kv[rollout_tp]

    def decode_step(self, rollout_tp: int, length_biased_mean: float, batch: float) -> float:
        """Seconds of one decode step at `batch` running sequences (a mean over steps may be fractional; the
        cost model takes it to the nearest whole sequence) whose mean live context is
        prompt + length_biased_mean / 2 (the cost model uses prompt + response / 2)."""
        if self.measured is not None:
            return self.measured.decode_fixed_s + self.measured.decode_per_seq_s * batch
        whole = max(1, int(round(batch)))
        key = (rollout_tp, max(1, int(round(length_biased_mean / LENGTH_BUCKET))), whole)
        if key not in self._decode:
            self._decode[key] = float(decode_step_s(self.with_response(length_biased_mean), rollout_tp, whole))
        return self._decode[key]

    def prefill_s(self, rollout_tp: int, instances: int) -> float:
        """Prefill seconds of one step's prompts over `instances` instances (the cost model's formula)."""
        if self.measured is not None:
            return 0.0
        w, spec, gpu, cost = self.inputs.workload, self.inputs.model, self.inputs.cluster.gpu, self.inputs.cost
        tokens = w.batch_size * w.prompt_tokens
        return tokens * forward_flops_per_token(spec, w.prompt_tokens) / (
            max(1, instances) * rollout_tp * gpu.bf16_flops * cost.prefill_mfu * cost.rollout_speed_factor)

    def train_side_s(self, layout: TrainLayout, dp: int, mean_response: float) -> float:
        """Training + log-prob recomputation seconds of one step at `mean_response` tokens per response."""
        if self.measured is not None:
            w = self.inputs.workload
            tokens = w.samples_per_step * (w.prompt_tokens + mean_response)
            return self.measured.train_step_s + self.measured.train_token_s * tokens / max(1, dp)
        key = (layout, dp, max(1, int(round(mean_response / LENGTH_BUCKET))))
        if key not in self._train:
            costs = train_costs(self.with_response(mean_response), layout, dp)
            self._train[key] = float(costs["train_s"]) + float(costs["logprob_recompute_s"])
        return self._train[key]

    def reload_s(self, rollout_tp: int) -> float:
        """Seconds one instance is down to apply new weights (reload + transfer), per sync."""
        if self.measured is not None:
            return self.measured.sync_s
        if rollout_tp not in self._sync:
            capacity = max(1, kv_capacity_sequences(self.inputs, rollout_tp))
            per_step = float(rollout_costs(self.inputs, rollout_tp, 1, capacity)["weight_sync_s"])
            self._sync[rollout_tp] = per_step * self.inputs.workload.sync_interval
        return self._sync[rollout_tp]

    def sync_timing(self, rollout_tp: int, rollout_gpus: int) -> tuple[float, float]:
        """(seconds the rollout pool loses, seconds until every instance serves the new version)."""
        one = self.reload_s(rollout_tp)
        if self.reload_strategy == "serial":
            nodes = max(1, math.ceil(rollout_gpus / self.inputs.cluster.gpus_per_node))
            return one, one * nodes
        return one, one
