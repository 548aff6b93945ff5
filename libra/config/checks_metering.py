"""Cross-field checks of metered logical GPUs (`cluster.metered_cpu_per_gpu`): only on logical GPUs, a quota
the kernel takes, and a CPU controller this machine lets the job write (probed; Not validated where none)."""

from __future__ import annotations

from collections.abc import Iterator

from libra.config.context import Finding, RuleContext
from libra.metering.cgroup import availability
from libra.metering.spec import MIN_CORES

METERED = "cluster.metered_cpu_per_gpu"


def metered_needs_logical(c: RuleContext) -> Iterator[Finding]:
    cores = c.cfg.cluster.metered_cpu_per_gpu
    if cores > 0 and not c.is_cpu:
        yield Finding(METERED, "meters logical GPUs (CPU slices); a real GPU's speed is the GPU's",
                      "set cluster.metered_cpu_per_gpu: 0, or run on logical GPUs (cluster.logical_gpus: true)")
    elif 0 < cores < MIN_CORES:
        yield Finding(METERED, f"is below the smallest CPU quota the kernel takes ({MIN_CORES} core)",
                      f"use 0 (off) or at least {MIN_CORES}")


def metered_root_ignored(c: RuleContext) -> Iterator[Finding]:
    cluster = c.cfg.cluster
    if cluster.metered_cgroup_root and cluster.metered_cpu_per_gpu == 0:
        yield Finding("cluster.metered_cgroup_root", "is ignored while cluster.metered_cpu_per_gpu is 0",
                      "set cluster.metered_cpu_per_gpu, or remove cluster.metered_cgroup_root")


def metering_controller(c: RuleContext) -> Iterator[Finding]:
    cluster = c.cfg.cluster
    if not (c.is_cpu and cluster.metered_cpu_per_gpu >= MIN_CORES):
        return
    reason = availability(cluster.metered_cgroup_root)
    if reason:
        yield Finding(METERED, f"cannot be enforced on this machine ({reason}), and the job does not run "
                      "unmetered in its place",
                      "run as root where the cgroup v1 cpu controller or a cgroup v2 cpu controller is writable "
                      "(or point cluster.metered_cgroup_root at one), or set cluster.metered_cpu_per_gpu: 0")
