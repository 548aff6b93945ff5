"""The hook a GPU holder calls to run in its CPU slice: `GpuHolderSlice`.

A holder is the process that Ray gives logical GPUs to: a rollout instance's host actor (its vLLM server runs
in the slice, the host itself does not) or a training worker (the worker runs in the slice, with every
process it starts later). With metering off every call does nothing; with metering on and no writable CPU
controller the first call raises `MeteringError` rather than run unmetered.
"""

from __future__ import annotations

import logging
import os

from libra.metering.cgroup import CgroupUnavailable, find_cpu_cgroup
from libra.metering.slices import CpuSlices, Slice
from libra.metering.spec import CpuMetering

log = logging.getLogger(__name__)


class MeteringError(RuntimeError):
    """Metering is on but the holder cannot be metered (no CPU controller, or no GPUs held)."""


def visible_gpus() -> int:
    """The logical GPUs Ray gave this process (`CUDA_VISIBLE_DEVICES`)."""
    return len([g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()])


class GpuHolderSlice:
    """The slice of holder `holder` (owned by this process) under `metering`; idle when metering is off."""

    def __init__(self, metering: CpuMetering | None, holder: str) -> None:
        self.metering = metering
        self.holder = holder
        self.slice: Slice | None = None
        self._slices: CpuSlices | None = None

    @property
    def enabled(self) -> bool:
        return self.metering is not None and self.metering.enabled

    def hold(self, pid: int, gpus: int | None = None) -> Slice | None:
        """Run `pid` and its descendants in this holder's slice, sized for `gpus` (default: the GPUs Ray gave
        this process); a second call with another GPU count resizes the slice. Returns the slice (None when
        metering is off)."""
        if not self.enabled:
            return None
        assert self.metering is not None
        gpus = visible_gpus() if gpus is None else gpus
        if gpus < 1:
            raise MeteringError(f"{self.holder}: cluster.metered_cpu_per_gpu is set but this process holds no "
                                "logical GPU (CUDA_VISIBLE_DEVICES is empty), so its slice has no size; run it "
                                "as a Ray actor with num_gpus, or set cluster.metered_cpu_per_gpu: 0")
        cores = self.metering.cores_for(gpus)
        if self._slices is None:
            try:
                self._slices = CpuSlices(find_cpu_cgroup(self.metering.cgroup_root), self.metering.job)
            except CgroupUnavailable as exc:
                raise MeteringError(f"{self.holder}: cluster.metered_cpu_per_gpu is set but {exc}; set "
                                    "cluster.metered_cpu_per_gpu: 0 to run unmetered") from exc
        if self.slice is None:
            self.slice = self._slices.open(self.holder, cores)
        elif self.slice.cores != cores:
            self.slice = self._slices.resize(self.slice, cores)
        moved = self._slices.join(self.slice, pid)
        log.info("%s: %d process(es) in CPU slice %s (%.2f cores for %d GPU(s))", self.holder, len(moved),
                 self.slice.name, cores, gpus)
        return self.slice

    def release(self) -> None:
        """Remove the slice (what still runs in it goes back to the controller's home group)."""
        if self.slice is None or self._slices is None:
            return
        piece, self.slice = self.slice, None
        try:
            self._slices.remove(piece)
        except OSError as exc:  # the next start sweeps it once the owner is gone
            log.warning("%s: could not remove CPU slice %s: %s", self.holder, piece.name, exc)


def end_job(metering: CpuMetering | None, wait_s: float = 10.0) -> int:
    """At the end of a job, on the machine that ran it: remove every slice of the job (holders that stopped
    cleanly removed theirs already; this takes the ones of holders that were killed), waiting up to `wait_s`
    for their owners to exit. Returns how many were removed; nothing to do when metering is off or no
    controller can be written here."""
    if metering is None or not metering.enabled:
        return 0
    try:
        cgroup = find_cpu_cgroup(metering.cgroup_root)
    except CgroupUnavailable:
        return 0
    return len(CpuSlices(cgroup, metering.job).remove_job(wait_s))
