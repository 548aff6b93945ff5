"""What a cross-field check sees: the built `Config`, which options the user wrote, and the facts
looked up once for every rule (model architecture, GPU type). Also `Finding`, what a check reports,
and small helpers the checks share (divisors, "choose from" lists)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from libra.config.errors import MISSING_VALUE
from libra.config.schema import Config
from planner.hardware import GPUSpec, UnknownGPUError
from planner.model_spec import ModelSpec, ModelSpecError


@dataclass(frozen=True)
class Finding:
    """One violation found by a check: the option to change, the broken rule (with the values involved)
    and the fix. `value` defaults to the option's current value."""

    path: str
    rule: str
    fix: str
    value: Any = MISSING_VALUE


class RuleContext:
    """Inputs of the cross-field checks, computed once per validation run."""

    def __init__(self, cfg: Config, provided: set[str]) -> None:
        self.cfg = cfg
        self.provided = provided
        self.model: ModelSpec | None = None
        self.model_error = ""
        try:
            self.model = cfg.model_spec()
        except (ModelSpecError, OSError, ValueError, TypeError) as exc:
            self.model_error = str(exc)
        self.gpu: GPUSpec | None = None
        self.gpu_missing: tuple[str, ...] = ()  # cluster.gpu_spec figures an undescribed gpu_type needs
        try:
            self.gpu = cfg.cluster.gpu()
        except UnknownGPUError as exc:
            self.gpu_missing = exc.missing

    @property
    def planner(self) -> Any:
        return self.cfg.global_resource_planner

    @property
    def total_gpus(self) -> int:
        return self.cfg.total_gpus

    @property
    def is_cpu(self) -> bool:
        return self.cfg.cluster.logical_gpus

    @property
    def pinned(self) -> bool:
        """The split is pinned by the user (initial_allocation_strategy configured)."""
        return bool(self.planner.initial_allocation_strategy == "configured")

    @property
    def managed_rollout(self) -> bool:
        return bool(self.planner.runtime_manage_rollout_processes)

    def is_set(self, path: str) -> bool:
        """Whether the user wrote this option (in YAML or with --set)."""
        return path in self.provided


def value_at(cfg: Any, path: str) -> Any:
    """The value of a dotted option path ("cluster.num_nodes", "x.allowed_train_tp[1]") in a config tree."""
    obj = cfg
    for part in path.split("."):
        name, _, index = part.partition("[")
        obj = obj[name] if isinstance(obj, dict) else getattr(obj, name, MISSING_VALUE)
        if index:
            try:
                obj = obj[int(index.rstrip("]"))]
            except (IndexError, TypeError, ValueError):
                return MISSING_VALUE
        if obj is MISSING_VALUE:
            return obj
    return obj


DIVISOR_SEARCH = 1 << 16  # candidates tried by `divisors`: complete for n up to 2^32, bounded work for any n


def divisors(n: int, limit: int | None = None) -> list[int]:
    """Positive divisors of n (up to `limit`), ascending. Found in pairs (d, n // d) with d up to sqrt(n), and d
    at most `DIVISOR_SEARCH`, so a value far beyond any cluster (a typo, fuzzed input) costs no more than a
    realistic one: above 2^32 the list holds the divisors up to 2^16 and their cofactors only."""
    if n <= 0:
        return []
    found: set[int] = set()
    for d in range(1, min(math.isqrt(n), DIVISOR_SEARCH) + 1):
        if n % d == 0:
            found.update((d, n // d))
    return sorted(d for d in found if limit is None or d <= limit)


def common_divisors(*values: int, limit: int | None = None) -> list[int]:
    g = 0
    for v in values:
        g = math.gcd(g, v)
    return divisors(g, limit)


def one_of(values: list[int]) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"
