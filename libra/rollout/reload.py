"""The weight reload protocol's data and rules: ACKs, their validation, the serial (node by node) order and
the refresh report. The pool (`pool.py`) runs the protocol; everything here is pure.

One publish covers the complete instance set. Each instance answers with one ACK; the publisher accepts the
refresh only when every expected instance ACKed the published weight version with the published checksum,
reported no parameter left unloaded or differing, and agrees across its TP workers. Anything else is a
`WeightSyncError` that names each failing instance and why. A publish may instead leave out the instances
whose server failed (it was failed already, or died or hung during its reload: `ReloadAck.server_failed`);
they keep their old weights, stay failed for the caller to replace, and are named in `ReloadReport.left_out`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from libra.rollout.spec import RolloutError


@dataclass(frozen=True)
class ReloadAck:
    """One instance's answer to a reload request. Times are seconds measured by the pool around the
    instance's reload, except `model_load_s` for `inplace`, which the server measures around its load."""

    instance_id: str
    host: str
    method: str
    strategy: str
    weight_version: int
    checksum: str
    lock_wait_s: float
    process_stop_s: float
    model_load_s: float
    total_s: float
    workers: int = 1
    worker_checksums: tuple[str, ...] = ()
    params_not_loaded: tuple[str, ...] = ()
    param_value_mismatches: tuple[str, ...] = ()
    params_value_checked: int = 0
    pid: int = 0
    started_s: float = 0.0  # offsets from the publish start: show the serial / parallel schedule
    finished_s: float = 0.0
    error: str = ""
    server_failed: bool = False  # the error is its server's failure (no /health), not a wrong reload

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ReloadReport:
    """The validated ACK batch of one refresh."""

    weight_version: int
    method: str
    strategy: str
    checksum: str
    acks: tuple[ReloadAck, ...]
    acks_expected: int
    acks_validated: int
    total_s: float
    slowest_instance: str
    slowest_total_s: float
    order: tuple[tuple[str, ...], ...] = ()  # the waves in which instances were reloaded
    left_out: tuple[tuple[str, str], ...] = ()  # (instance id, why) of instances whose server failed

    def phase_summary(self) -> dict[str, dict[str, float]]:
        """max and mean of every ACK timing over the batch."""
        out: dict[str, dict[str, float]] = {}
        for name in ("lock_wait_s", "process_stop_s", "model_load_s", "total_s"):
            values = [float(getattr(a, name)) for a in self.acks]
            if values:
                out[name] = {"max": max(values), "mean": sum(values) / len(values)}
        return out

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["phases"] = self.phase_summary()
        return data


class WeightSyncError(RolloutError):
    """A refresh whose ACK batch is incomplete or wrong; `failures` maps instance id -> reason."""

    def __init__(self, version: int, failures: dict[str, str], acks: Sequence[ReloadAck] = ()) -> None:
        self.version = version
        self.failures = dict(failures)
        self.acks = tuple(acks)
        lines = "\n  ".join(f"{iid}: {why}" for iid, why in sorted(self.failures.items()))
        super().__init__(
            f"weight version {version} was not applied on {len(self.failures)} instance(s):\n  {lines}"
        )


@dataclass
class AckExpectation:
    version: int
    checksum: str
    method: str
    strategy: str
    instance_ids: list[str] = field(default_factory=list)


def validate_acks(expect: AckExpectation, acks: Iterable[ReloadAck]) -> dict[str, str]:
    """Every problem of the ACK batch as {instance id: reason}; empty when the batch is complete and right."""
    failures: dict[str, str] = {}
    seen: dict[str, ReloadAck] = {}
    for ack in acks:
        if ack.instance_id in seen:
            failures[ack.instance_id] = "sent more than one ACK"
            continue
        seen[ack.instance_id] = ack
        if ack.instance_id not in expect.instance_ids:
            failures[ack.instance_id] = "ACKed a refresh it was not part of"
            continue
        problem = ack_problem(expect, ack)
        if problem:
            failures[ack.instance_id] = problem
    for iid in expect.instance_ids:
        if iid not in seen:
            failures[iid] = "no ACK (the instance did not answer the reload request)"
    return failures


def ack_problem(expect: AckExpectation, ack: ReloadAck) -> str:
    """Why `ack` does not confirm the expected refresh, or "" when it does."""
    if ack.error:
        return f"reload failed: {ack.error}"
    if ack.method != expect.method or ack.strategy != expect.strategy:
        return (
            f"ACK for method={ack.method}/strategy={ack.strategy}, expected {expect.method}/{expect.strategy}"
        )
    if ack.weight_version != expect.version:
        return f"holds weight version {ack.weight_version}, expected {expect.version}"
    if ack.checksum != expect.checksum:
        return f"loaded weights with checksum {ack.checksum}, published {expect.checksum}"
    if ack.worker_checksums and any(c != ack.checksum for c in ack.worker_checksums):
        return f"its {ack.workers} TP workers disagree on the loaded weights: {list(ack.worker_checksums)}"
    if ack.params_not_loaded:
        return f"parameters not loaded by the reload: {list(ack.params_not_loaded)[:8]}"
    if ack.param_value_mismatches:
        return f"parameters differ from the published tensors: {list(ack.param_value_mismatches)[:8]}"
    timings = {k: getattr(ack, k) for k in ("lock_wait_s", "process_stop_s", "model_load_s", "total_s")}
    bad = {k: v for k, v in timings.items() if not (v >= 0.0)}
    if bad:
        return f"invalid timings {bad}"
    return ""


def serial_waves(instances: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Node by node, one instance at a time: [(id, node)] -> waves of one instance, grouped by node in order
    of first appearance, so no node ever loads two models at once and nodes follow each other."""
    by_node: dict[str, list[str]] = {}
    for iid, node in instances:
        by_node.setdefault(node, []).append(iid)
    return [[iid] for node in by_node for iid in by_node[node]]


def parallel_waves(instances: Iterable[tuple[str, str]]) -> list[list[str]]:
    ids = [iid for iid, _ in instances]
    return [ids] if ids else []


def leave_out_failed_servers(
    expect: AckExpectation, acks: Sequence[ReloadAck]
) -> tuple[AckExpectation, list[ReloadAck], dict[str, str]]:
    """The expectation and ACKs without the instances whose server failed, and those instances with why. When
    every instance's server failed, all are left out: the weights reached no server, and the replacements start
    on them (a job with a single rollout instance rides through losing it)."""
    failed = {a.instance_id: ack_problem(expect, a) for a in acks if a.server_failed}
    kept_ids = [iid for iid in expect.instance_ids if iid not in failed]
    kept = AckExpectation(expect.version, expect.checksum, expect.method, expect.strategy, kept_ids)
    return kept, [a for a in acks if a.instance_id not in failed], failed


def build_report(
    expect: AckExpectation, acks: Sequence[ReloadAck], total_s: float, waves: Sequence[Sequence[str]],
    left_out: dict[str, str] | None = None,
) -> ReloadReport:
    slowest = max(acks, key=lambda a: a.total_s) if acks else None
    return ReloadReport(
        weight_version=expect.version,
        method=expect.method,
        strategy=expect.strategy,
        checksum=expect.checksum,
        acks=tuple(sorted(acks, key=lambda a: a.instance_id)),
        acks_expected=len(expect.instance_ids),
        acks_validated=len(acks),
        total_s=total_s,
        slowest_instance=slowest.instance_id if slowest else "",
        slowest_total_s=slowest.total_s if slowest else 0.0,
        order=tuple(tuple(w) for w in waves),
        left_out=tuple(sorted((left_out or {}).items())),
    )


def is_sync_step(step: int, sync_interval: int) -> bool:
    """Whether the trainer publishes weights after `step` (1-based) with `sync_interval` steps between syncs."""
    if sync_interval < 1:
        raise ValueError(f"sync_interval={sync_interval}: must be >= 1 (steps between weight syncs)")
    return step >= 1 and step % sync_interval == 0
