"""`CpuMetering`: how GPU holders meter their CPU time, as the pool specs carry it (built from
`cluster.metered_cpu_per_gpu` and `cluster.metered_cgroup_root` by `libra.config.mapping.cpu_metering`)."""

from __future__ import annotations

from dataclasses import dataclass

# The CFS period of every slice. A slice may spend a whole period's quota in one burst at full core speed, which a
# GPU cannot: with 100 ms, a 0.2-core slice that idled ran 20 ms of CPU unthrottled, more than a dev-model training
# rank's forward and backward. With 20 ms the burst is 4 ms, so tens of milliseconds of CPU run at the slice's rate.
PERIOD_US = 20_000
# The kernel refuses a CFS quota under 1 ms per period (cgroup v1; v2 takes the same minimum)
MIN_QUOTA_US = 1_000
MIN_CORES = MIN_QUOTA_US / PERIOD_US


@dataclass(frozen=True, kw_only=True)
class CpuMetering:
    """`cores_per_gpu` (0 = off): a holder of g logical GPUs gets at most g x cores_per_gpu cores. `job` names
    the job's slices (name and run directory), so that a job removes its own; `cgroup_root` is the cgroup
    under which slices are made ("" = the CPU controller's cgroup this process runs in)."""

    cores_per_gpu: float
    job: str
    cgroup_root: str

    @property
    def enabled(self) -> bool:
        return self.cores_per_gpu > 0

    def cores_for(self, gpus: int) -> float:
        """The CPU quota, in cores, of a holder of `gpus` GPUs."""
        return max(MIN_CORES, gpus * self.cores_per_gpu)


OFF = CpuMetering(cores_per_gpu=0.0, job="", cgroup_root="")
