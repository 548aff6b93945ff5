"""What a search returns: candidates, their evaluations, pruned candidates with reasons, the order of
preference between candidates, advice on the largest phase, and the `Plan`.

Pure: stdlib only (numbers come in already computed; pruned split lists may be numpy arrays).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from planner.layout import Rule, TrainLayout
from planner.memory import MemoryEstimate
from planner.workload import PlannerInputs


@dataclass(frozen=True, order=True)
class Candidate:
    """One train/rollout split with its training layout and rollout instance size (ordered by its fields, so
    that a set of splits sorts the same way every run)."""

    train_gpus: int
    rollout_gpus: int
    layout: TrainLayout
    rollout_tp: int

    @property
    def dp(self) -> int:
        return self.train_gpus // self.layout.model_parallel

    @property
    def rollout_instances(self) -> int:
        return self.rollout_gpus // self.rollout_tp

    @property
    def total_gpus(self) -> int:
        return self.train_gpus + self.rollout_gpus

    def label(self) -> str:
        return (f"train {self.train_gpus} GPUs ({self.layout.label()} dp={self.dp}) | rollout {self.rollout_gpus} "
                f"GPUs ({self.rollout_instances} x tp={self.rollout_tp})")


@dataclass(frozen=True)
class Evaluation:
    """Memory, phase times and throughput of one candidate, and every rule it breaks."""

    candidate: Candidate
    train_memory: MemoryEstimate
    rollout_memory: MemoryEstimate
    train: dict[str, float]
    rollout: dict[str, float]
    step_s: float
    samples_per_s: float
    tokens_per_s: float
    kv_capacity_sequences: int
    violations: tuple[Rule, ...] = ()

    @property
    def feasible(self) -> bool:
        return not self.violations

    @property
    def train_side_s(self) -> float:
        return self.train["train_s"] + self.train["logprob_recompute_s"]

    @property
    def rollout_side_s(self) -> float:
        return self.rollout["generation_s"] + self.rollout["weight_sync_s"]

    @property
    def phases(self) -> dict[str, float]:
        """Seconds of each phase of one step (weight sync per step, i.e. divided by sync_interval)."""
        return {"generation": self.rollout["generation_s"], "weight_sync": self.rollout["weight_sync_s"],
                "logprob_recompute": self.train["logprob_recompute_s"], "train": self.train["train_s"]}

    def tie_key(self) -> tuple[int, int, float, float, tuple[int, int, int, int], float, int]:
        """Order among candidates whose throughput ties (see `rank`): more training-memory headroom (in whole
        MB, so rounding never decides), fewer training GPUs, then higher throughput, less training time,
        smaller layout, less rollout time, smaller rollout TP."""
        c, lay = self.candidate, self.candidate.layout
        return (-headroom_units(self.train_memory.headroom_bytes), c.train_gpus, -self.samples_per_s,
                self.train_side_s, (lay.tp, lay.pp, lay.cp, lay.ep), self.rollout_side_s, c.rollout_tp)


# Candidates within this relative distance of the best throughput tie: the cost model is not that precise, so
# the one with more memory headroom (then fewer training GPUs) is the safer choice.
THROUGHPUT_TIE_TOLERANCE = 0.005
HEADROOM_UNIT_BYTES = 10**6


def headroom_units(headroom_bytes: float) -> int:
    """Headroom in whole MB (floor), the unit in which the tie-break compares it."""
    return int(headroom_bytes // HEADROOM_UNIT_BYTES)


def in_tie(samples_per_s: float, best_samples_per_s: float) -> bool:
    """Whether a throughput ties with the best one (within `THROUGHPUT_TIE_TOLERANCE`)."""
    return samples_per_s >= best_samples_per_s * (1.0 - THROUGHPUT_TIE_TOLERANCE)


def rank(evaluations: Iterable[Evaluation], limit: int | None = None) -> list[Evaluation]:
    """Evaluations in order of preference: repeatedly, among those left, the candidates that tie with the best
    throughput left, and of them the first by `Evaluation.tie_key`."""
    left = list(evaluations)
    ranked: list[Evaluation] = []
    while left and (limit is None or len(ranked) < limit):
        best = max(e.samples_per_s for e in left)
        pick = min((e for e in left if in_tie(e.samples_per_s, best)), key=Evaluation.tie_key)
        ranked.append(pick)
        left.remove(pick)
    return ranked


@dataclass(frozen=True)
class PhaseAdvice:
    """A phase that dominates the step, one option that changes it, and what the cost model predicts with the
    option changed (the search re-run on the changed inputs)."""

    phase: str  # a key of `Evaluation.phases`
    phase_s: float
    step_s: float
    samples_per_s: float
    option: str  # the setting to write, e.g. "rollout_weight_reload_method: inplace"
    effect: str  # what the option does, in words
    new_phase_s: float
    new_step_s: float
    new_samples_per_s: float
    new_split: str = ""  # the re-planned split when it differs from the chosen one

    @property
    def share(self) -> float:
        """Share of the step time the phase takes today."""
        return self.phase_s / self.step_s

    @property
    def gain(self) -> float:
        """Relative change of samples per second."""
        return self.new_samples_per_s / self.samples_per_s - 1.0

    def message(self) -> str:
        moved = f" (re-planned split: {self.new_split})" if self.new_split else ""
        return (f"{self.phase.replace('_', ' ')} takes {self.phase_s:.1f} s of the {self.step_s:.1f} s step "
                f"({self.share:.0%}): {self.option} ({self.effect}) makes it {self.new_phase_s:.1f} s and the "
                f"step {self.new_step_s:.1f} s, {self.gain:+.0%} samples/s{moved}")


@dataclass(frozen=True)
class Pruned:
    """Candidates removed for one reason. No training-pool sizes means every split of that layout/rollout TP.

    `gpus` holds the training-pool sizes as a tuple or an integer array (the search passes arrays; they become
    tuples only when someone asks, so a 4096-GPU search does not build millions of Python ints).
    """

    kind: str  # "train_layout" | "train_split" | "rollout"
    code: str
    reason: str
    layout: TrainLayout | None = None
    rollout_tp: int | None = None
    gpus: Any = ()
    # for rules that compare a number with a limit (ratios, peak bytes): the smallest value among the pruned
    # candidates (the first a higher limit would admit) and the limit it broke
    value: float | None = None
    threshold: float | None = None

    @property
    def train_gpus(self) -> tuple[int, ...]:
        return self.gpus if isinstance(self.gpus, tuple) else tuple(self.gpus.tolist())

    @property
    def size(self) -> int:
        """Number of training-pool sizes listed (0 = every split)."""
        return len(self.gpus)

    def subject(self) -> str:
        what = self.layout.label() if self.layout is not None else f"rollout tp={self.rollout_tp}"
        if not self.train_gpus:
            return f"{what}, every split"
        return f"{what}, train GPUs {format_ranges(self.train_gpus)}"


def format_ranges(values: tuple[int, ...]) -> str:
    """`(8, 16, 24, 40)` -> `8-24 (step 8), 40`: compact, exact."""
    if not values:
        return ""
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        step = values[i + 1] - values[i] if i + 1 < len(values) else 0
        while j + 1 < len(values) and values[j + 1] - values[j] == step and step > 0:
            j += 1
        if j - i >= 2:
            parts.append(f"{values[i]}-{values[j]}" + (f" (step {step})" if step != 1 else ""))
            i = j + 1
        else:
            parts.append(str(values[i]))
            i += 1
    return ", ".join(parts)


@dataclass
class Plan:
    """Result of a search (or of checking a pinned split)."""

    inputs: PlannerInputs
    strategy: str
    feasible: bool
    chosen: Evaluation | None
    alternatives: list[Evaluation] = field(default_factory=list)
    pruned: list[Pruned] = field(default_factory=list)
    candidates_evaluated: int = 0
    warnings: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    search_s: float = 0.0
    splits: tuple[int, ...] = ()  # training-pool sizes the search considered
    baseline: Evaluation | None = None  # the configured split, evaluated for comparison (grp)
    phase_advice: list[PhaseAdvice] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return "async" if self.inputs.workload.is_async else "sync"

    def pruned_counts(self) -> dict[str, int]:
        """Number of pruned (layout or rollout TP, split) candidates per reason code."""
        counts: dict[str, int] = {}
        for p in self.pruned:
            n = p.size or max(1, len(self.splits))
            counts[p.code] = counts.get(p.code, 0) + n
        return dict(sorted(counts.items()))
