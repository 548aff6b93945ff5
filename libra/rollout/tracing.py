"""Phase traces of the rollout instances, written by the pool process on their behalf.

A vLLM server runs no Libra code that could trace, so the pool records what it measured about each instance
into that instance's own file, `phase_trace_rank{2000 + i}.jsonl` (`i` from the instance id `rollout-i`):
one `weight_sync.reload` span per reload ACK, placed from the ACK's start/finish offsets and carrying
`flow_id` = the published weight version, so the converter draws an arrow from the publish to every reload.
Tracing never fails a reload: an instance whose rank or directory cannot be traced is skipped with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from libra.observability.phase_trace import PhaseTracer, TraceSettings
from libra.observability.trace_schema import rank_for
from libra.rollout.lifecycle import instance_index
from libra.rollout.reload import ReloadAck

log = logging.getLogger(__name__)

RELOAD_PHASE = "weight_sync.reload"
_ACK_TIMINGS = ("lock_wait_s", "process_stop_s", "model_load_s", "total_s")


class InstanceTracers:
    """One tracer per rollout instance, opened on its first record, all closed by `close()`."""

    def __init__(self, settings: TraceSettings | None) -> None:
        self.settings = settings
        self._tracers: dict[str, PhaseTracer] = {}

    @property
    def enabled(self) -> bool:
        return self.settings is not None and self.settings.enabled

    def tracer(self, instance_id: str) -> PhaseTracer:
        """The tracer of `instance_id` (a disabled one when tracing is off or the instance cannot be traced)."""
        tracer = self._tracers.get(instance_id)
        if tracer is None:
            tracer = self._tracers[instance_id] = self._open(instance_id)
        return tracer

    def _open(self, instance_id: str) -> PhaseTracer:
        if self.settings is None or not self.settings.enabled:
            return PhaseTracer.disabled("rollout", 0)
        try:
            rank = rank_for("rollout", instance_index(instance_id))
            return PhaseTracer.from_settings(self.settings, role="rollout", rank=rank)
        except (ValueError, OSError) as exc:
            log.warning("rollout instance %s writes no phase trace: %s", instance_id, exc)
            return PhaseTracer.disabled("rollout", 0)

    def record_reloads(self, acks: Iterable[ReloadAck], version: int, publish_start_ns: int) -> None:
        """One `weight_sync.reload` span per ACK; `publish_start_ns` (epoch ns) is the instant the ACKs'
        `started_s` / `finished_s` offsets count from."""
        if not self.enabled:
            return
        for ack in acks:
            start = publish_start_ns + round(ack.started_s * 1e9)
            end = max(start, publish_start_ns + round(ack.finished_s * 1e9))
            attrs: dict[str, Any] = {
                "flow_id": version,
                "instance_id": ack.instance_id,
                "method": ack.method,
                "strategy": ack.strategy,
                "weight_version": ack.weight_version,
                **{name: getattr(ack, name) for name in _ACK_TIMINGS},
            }
            if ack.error:
                attrs["error"] = ack.error
            self.tracer(ack.instance_id).record(RELOAD_PHASE, start, end, step=version, **attrs)

    def close(self) -> None:
        """Write out every instance's remaining records; later records open the files again."""
        tracers, self._tracers = list(self._tracers.values()), {}
        for tracer in tracers:
            tracer.close()
