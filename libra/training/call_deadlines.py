"""How long a training pool's collective calls may run before the pool counts as hung.

A rank that stops answering (a frozen process, a collective that never completes, a device that hangs) does
not fail its call: it never returns, and every other rank waits for it inside the same collective. Nothing
raises, so the pool can only tell from time. The rule (`HangRule`): a call may run `timeout_s`, or `factor`
times the slowest call of the same kind that completed at the pool's current size and layout, whichever is
longer. A kind of call that has not completed there yet (a first step carries the warm-up, a first load the
whole read) may run `first_call_s`. `factor` 0 leaves `timeout_s` alone. The history is of one pool shape
(`CallDeadlines.at`): at another size or layout calls take other times, so it starts again.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class HangRule:
    """`train_hang_timeout_s`, `train_hang_timeout_factor`, and what a call without history may take."""

    timeout_s: float
    factor: float
    first_call_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.factor < 0 or self.first_call_s <= 0:
            raise ValueError(f"hang rule needs timeout_s > 0, factor >= 0 and first_call_s > 0: {self}")


class CallDeadlines:
    """The slowest completed call of each kind, and the deadline of the next one."""

    def __init__(self, rule: HangRule) -> None:
        self.rule = rule
        self._slowest: dict[str, float] = {}
        self._shape: Hashable = None  # the pool shape (size, layout) the history is of

    def deadline(self, kind: str) -> float:
        """Seconds the next `kind` call may run before the pool counts as hung."""
        slowest = self._slowest.get(kind)
        if slowest is None:
            return max(self.rule.timeout_s, self.rule.first_call_s)
        return max(self.rule.timeout_s, self.rule.factor * slowest)

    def completed(self, kind: str, seconds: float) -> None:
        self._slowest[kind] = max(seconds, self._slowest.get(kind, 0.0))

    def at(self, shape: Hashable) -> None:
        """The pool runs at `shape` (its size and layout) from now on; at another shape than before, every kind
        of call starts again without history."""
        if shape != self._shape:
            self._slowest.clear()
            self._shape = shape

    def history(self) -> dict[str, float]:
        return dict(self._slowest)
