"""The chain of causes of an error: the error, then what it was raised from (`__cause__`) or while handling
(`__context__`), and so on. Several parts of the controller decide from an error somewhere in that chain (a lost
training worker, a placement that timed out, a full disk, nodes that cannot reach each other)."""

from __future__ import annotations

from collections.abc import Iterator


def causes(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and every error it came from, nearest first; each once (a chain that loops ends there)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
