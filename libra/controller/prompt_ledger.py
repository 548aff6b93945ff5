"""Which prompts of the training stream are done, so that a resume draws exactly those that are not.

Groups finish out of order (their generations run concurrently), and a prompt may wait for a retry after its
generation failed, so "the first N prompts" is not what a checkpoint has trained. `PromptLedger` keeps the
lowest index not yet done (`position`: every prompt before it is done) and the indices done past it
(`done_ahead`, at most about one batch and what was in flight). A prompt is done once its group was trained, or
discarded as too stale to train (`max_head_offpolicyness`). A resume draws the stream from `position` and skips
`done_ahead`: each prompt is trained once, and one that was generating, buffered or waiting for a retry when the
checkpoint was written is drawn again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class PromptLedger:
    position: int = 0
    done_ahead: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.position < 0 or any(i < self.position for i in self.done_ahead):
            raise ValueError(f"position {self.position} must be >= 0 and below every index done past it "
                             f"({sorted(self.done_ahead)})")
        self._advance()

    def done(self, indices: Iterable[int]) -> None:
        """The prompts of `indices` are done (trained, or discarded as stale)."""
        self.done_ahead.update(i for i in indices if i >= self.position)
        self._advance()

    def _advance(self) -> None:
        while self.position in self.done_ahead:
            self.done_ahead.remove(self.position)
            self.position += 1
