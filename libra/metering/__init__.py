"""Metered logical GPUs: on a CPU machine each logical GPU is a fixed slice of CPU time, enforced by the
kernel's CPU controller (cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us`).

- `spec`: `CpuMetering`, the setting the pool specs carry (cores per GPU, the job, the cgroup root).
- `cgroup`: the CPU controller itself (find the writable one, make groups, set quotas, move processes).
- `slices`: one slice per GPU holder, named by job, holder and owner pid; sweeping slices whose owner is gone.
- `holder`: the one-line hooks a GPU holder (a rollout server host, a training worker) calls.

No Ray here: the holders are Ray actors, but what they do with the kernel needs none.
"""
