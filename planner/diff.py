"""Differences between two plans (or two evaluated candidates): what a reconfiguration changes.

Compares the decision (split, layouts, rollout instances) and the predicted numbers (memory peaks, phase
times, throughput) field by field, using the JSON form so the paths match `libra plan --json`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.plan import Evaluation, Plan
from planner.report import evaluation_dict

DECISION_FIELDS = ("train.gpus", "train.tp", "train.pp", "train.cp", "train.ep", "train.vpp", "train.dp",
                   "rollout.gpus", "rollout.tp", "rollout.instances")
PREDICTION_FIELDS = ("rollout.batch_per_instance", "memory.train.peak_bytes", "memory.rollout.peak_bytes",
                     "times.generation_s", "times.logprob_recompute_s", "times.train_s", "times.step_s",
                     "throughput.samples_per_s", "throughput.tokens_per_s")


@dataclass(frozen=True)
class Change:
    """One field that differs; `decision` is True for split/layout fields (what the runtime must act on)."""

    path: str
    before: Any
    after: Any
    decision: bool

    def describe(self) -> str:
        if isinstance(self.before, float) or isinstance(self.after, float):
            rel = (self.after - self.before) / self.before if self.before else float("inf")
            return f"{self.path}: {self.before:.4g} -> {self.after:.4g} ({rel:+.1%})"
        return f"{self.path}: {self.before} -> {self.after}"


def _get(doc: dict[str, Any], path: str) -> Any:
    value: Any = doc
    for part in path.split("."):
        value = value[part]
    return value


def _evaluation(x: Plan | Evaluation) -> Evaluation | None:
    return x.chosen if isinstance(x, Plan) else x


def diff_plans(before: Plan | Evaluation, after: Plan | Evaluation, rel_tol: float = 1e-9) -> list[Change]:
    """Fields that differ, decision fields first. An infeasible plan (no chosen candidate) diffs as all
    decision fields going to/from None."""
    a, b = _evaluation(before), _evaluation(after)
    da = evaluation_dict(a) if a is not None else None
    db = evaluation_dict(b) if b is not None else None
    changes: list[Change] = []
    for fields, decision in ((DECISION_FIELDS, True), (PREDICTION_FIELDS, False)):
        for path in fields:
            va = _get(da, path) if da is not None else None
            vb = _get(db, path) if db is not None else None
            if isinstance(va, float) and isinstance(vb, float):
                if abs(va - vb) <= rel_tol * max(abs(va), abs(vb)):
                    continue
            elif va == vb:
                continue
            changes.append(Change(path, va, vb, decision))
    return changes


def format_diff(changes: list[Change]) -> str:
    if not changes:
        return "no change"
    return "\n".join(("* " if c.decision else "  ") + c.describe() for c in changes)
