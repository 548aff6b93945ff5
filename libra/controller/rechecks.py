"""Checks, again and again, of nodes the job left out because they could not reach their peers, until each
does: the thread behind the fence on partitioned training nodes (`libra.controller.node_loss`) and behind the
hold-back of lending nodes (`libra.controller.ehp_lenders`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from libra.cluster.node_fence import FencedNode

log = logging.getLogger(__name__)


class NodeRechecks:
    """Every `interval_s` while `pending()` lists nodes: `check(node)` (whether it reaches its peers again) for
    each, and `back(node)` for each that does. A daemon thread that `start()` starts unless it runs (nothing
    without `check`); it ends, under its lock, once nothing is pending, so a node left out before the next
    `start()` is never left unchecked. `stopping` ends it at once."""

    def __init__(self, name: str, interval_s: float, pending: Callable[[], list[FencedNode]],
                 check: Callable[[FencedNode], bool] | None, back: Callable[[FencedNode], None],
                 stopping: threading.Event) -> None:
        self.name = name
        self.interval_s = interval_s
        self.pending = pending
        self.check = check
        self.back = back
        self.stopping = stopping
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        if self.check is None:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        check = self.check
        assert check is not None
        while not self.stopping.wait(self.interval_s):
            with self._lock:
                if not self.pending():
                    self._thread = None
                    return
            for node in self.pending():
                try:
                    reached = check(node)
                except Exception:
                    log.info("%s: checking node %s failed", self.name, node.address, exc_info=True)
                    reached = False
                if reached:
                    self.back(node)
