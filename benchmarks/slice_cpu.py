"""Where the CPU of metered slices goes during a run: `SliceCpuSampler` and `cpu_by_phase`.

A run of the gain benchmark holds its logical GPUs as CPU slices (cgroups under `<cpu controller>/libra`). The
sampler reads, every `interval_s`, which processes each slice holds and their CPU time (user + system,
from psutil); `cpu_by_phase` then adds up, for the rollout and the training phases of every step after the
first (from the run's metrics rows), the cores each kind of process used, per kind of slice:

- in a rollout slice: `server` (the vLLM server's processes: guard, API server, engine core) and
  `borrowed_worker` (a training replica on the lent GPU, working or parked: a Ray worker);
- in a training slice: `training_worker` (the worker and anything it started);
- `left_slices`: a process seen in a slice before and outside every slice at both ends of an interval (a parked
  borrowed rank, which leaves its lent GPU's slice between steps), by the kind of the slice it was last in;
- `moving`: a process in a slice at one end of an interval and not at the other (or in another slice), whose
  CPU cannot be split between the two (a borrowed rank joining its slice at an attach).

Beside the slices, each sample reads the machine's busy CPU seconds (every core's user, nice, system, irq and
softirq time, from psutil), so each phase also gets `host_cores` (the cores the whole machine used) and
`outside_slices_cores` (host_cores less what the slices' processes used while in them: the controller, Ray,
the benchmark and anything else that runs outside the slices, `left_slices` and `moving` included; a slice
process that started between two samples counts there for that interval) and `host_steal_cores` (the cores' time the hypervisor gave to other machines while
this one wanted to run: a shared host's contention, 0 on bare metal).

A process's CPU between two samples counts for the phase the middle of the interval falls in; processes that
start and end between two samples are missed, and the sampler's own reads run outside every slice.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from libra.metering.cgroup import CpuCgroup
from libra.metering.slices import SliceName

PHASES = ("rollout", "train")


@dataclass(frozen=True)
class ProcessSample:
    """One process of one slice at one moment."""

    slice_holder: str  # "rollout-3", "train-0"
    pid: int
    cpu_s: float  # user + system seconds since the process started
    ray_worker: bool  # a Ray worker process (its command line starts with "ray::")
    inside: bool = True  # False: seen in `slice_holder` earlier, now outside every slice


@dataclass
class Snapshot:
    at: float  # time.time()
    processes: list[ProcessSample] = field(default_factory=list)
    host_busy_s: float | None = None  # the machine's busy CPU seconds since boot, all cores (None: not read)
    host_steal_s: float | None = None  # the machine's stolen CPU seconds since boot, all cores (None: not read)


def host_cpu_s() -> tuple[float, float]:
    """The machine's busy CPU seconds since boot (user, nice, system, irq and softirq; idle, iowait and steal
    left out) and its stolen ones (the hypervisor ran other machines while this one had work; 0 where the kernel
    does not report it), each summed over the cores, from one read."""
    times = psutil.cpu_times()
    busy = sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))
    return float(busy), float(getattr(times, "steal", 0.0))


def process_kind(sample: ProcessSample) -> str:
    """`server`, `borrowed_worker` or `training_worker` (see the module docstring)."""
    if sample.slice_holder.startswith("rollout"):
        return "borrowed_worker" if sample.ray_worker else "server"
    return "training_worker"


# the kinds of slice: a rollout instance's GPUs, a training worker's; `left_slices` and `moving` are not slices
SLICE_KINDS = ("rollout_slices", "train_slices")


def slice_kind(holder: str) -> str:
    rollout, train = SLICE_KINDS
    return rollout if holder.startswith("rollout") else train


def phase_intervals(rows: Iterable[Mapping[str, Any]]) -> list[tuple[str, float, float]]:
    """(phase, start, end) in wall-clock seconds of the rollout and training phases of every step but the first
    (it starts the borrowed workers): a row is written when its step ends (`wall_time`), and the step ran
    `time_step_s` with its rollout phase first."""
    out: list[tuple[str, float, float]] = []
    for row in list(rows)[1:]:
        start = float(row["wall_time"]) - float(row["time_step_s"])
        rollout_end = start + float(row["time_rollout_s"])
        out.append(("rollout", start, rollout_end))
        out.append(("train", rollout_end, rollout_end + float(row["time_train_s"])))
    return out


def cpu_by_phase(snapshots: Sequence[Snapshot], intervals: Sequence[tuple[str, float, float]]) -> dict[str, Any]:
    """Per phase: the seconds sampled in it and the cores each kind of process used in each kind of slice."""
    cpu: dict[tuple[str, str, str], float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    host: dict[str, float] = defaultdict(float)
    host_wall: dict[str, float] = defaultdict(float)
    host_slices: dict[str, float] = defaultdict(float)
    steal: dict[str, float] = defaultdict(float)
    steal_wall: dict[str, float] = defaultdict(float)
    for before, after in zip(snapshots, snapshots[1:], strict=False):
        middle = (before.at + after.at) / 2.0
        phase = next((name for name, start, end in intervals if start <= middle < end), None)
        if phase is None:
            continue
        wall[phase] += after.at - before.at
        busy = None if before.host_busy_s is None or after.host_busy_s is None else after.host_busy_s - before.host_busy_s
        if busy is not None:
            host[phase] += busy
            host_wall[phase] += after.at - before.at
        if before.host_steal_s is not None and after.host_steal_s is not None:
            steal[phase] += after.host_steal_s - before.host_steal_s
            steal_wall[phase] += after.at - before.at
        earlier = {p.pid: p for p in before.processes}
        for p in after.processes:
            first = earlier.get(p.pid)
            if first is None:
                continue
            used = p.cpu_s - first.cpu_s
            stayed = first.inside and p.inside and first.slice_holder == p.slice_holder
            where = slice_kind(p.slice_holder) if stayed else "left_slices" if not (first.inside or p.inside) \
                else "moving"
            cpu[(phase, where, process_kind(p))] += used
            if stayed and busy is not None:
                host_slices[phase] += used
    result: dict[str, Any] = {}
    for phase in PHASES:
        seconds = wall.get(phase, 0.0)
        kinds: dict[str, dict[str, float]] = defaultdict(dict)
        for (ph, where, kind), used in sorted(cpu.items()):
            if ph == phase and seconds > 0:
                kinds[where][kind] = round(used / seconds, 4)
        result[phase] = {"sampled_s": round(seconds, 2), "cores": dict(kinds)}
        if host_wall.get(phase, 0.0) > 0:
            result[phase]["host_cores"] = round(host[phase] / host_wall[phase], 4)
            result[phase]["outside_slices_cores"] = round((host[phase] - host_slices[phase]) / host_wall[phase], 4)
        if steal_wall.get(phase, 0.0) > 0:
            result[phase]["host_steal_cores"] = round(steal[phase] / steal_wall[phase], 4)
    return result


def read_slices(cgroup: CpuCgroup) -> list[ProcessSample]:
    """Every process of every slice of `cgroup` with its CPU seconds now (vanished processes are skipped)."""
    found: list[ProcessSample] = []
    for entry in cgroup.names():
        name = SliceName.parse(entry)
        if name is None:
            continue
        try:
            pids = cgroup.pids(cgroup.path(entry))
        except OSError:  # removed meanwhile
            continue
        for pid in pids:
            sample = _process(name.holder, pid)
            if sample is not None:
                found.append(sample)
    return found


def follow_left(found: Sequence[ProcessSample], seen: dict[int, str]) -> list[ProcessSample]:
    """The processes of `seen` (pid -> the slice it was last in, updated here from `found`) that are in no slice
    now, sampled with `inside=False`; processes that have exited are forgotten."""
    for p in found:
        seen[p.pid] = p.slice_holder
    inside = {p.pid for p in found}
    left = []
    for pid, holder in list(seen.items()):
        if pid in inside:
            continue
        sample = _process(holder, pid)
        if sample is None:
            del seen[pid]
        else:
            left.append(ProcessSample(holder, pid, sample.cpu_s, sample.ray_worker, inside=False))
    return left


def _process(holder: str, pid: int) -> ProcessSample | None:
    try:
        process = psutil.Process(pid)
        times = process.cpu_times()
        command = process.cmdline()
    except (psutil.Error, OSError):  # gone meanwhile, or not ours to read
        return None
    ray_worker = bool(command) and command[0].startswith("ray::")
    return ProcessSample(holder, pid, times.user + times.system, ray_worker)


class SliceCpuSampler:
    """A daemon thread that snapshots the slices of `cgroup` every `interval_s` until `stop()`."""

    def __init__(self, cgroup: CpuCgroup, interval_s: float = 0.5) -> None:
        self.cgroup = cgroup
        self.interval_s = interval_s
        self.snapshots: list[Snapshot] = []
        self._seen: dict[int, str] = {}  # every process seen in a slice: the slice it was last in
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slice-cpu-sampler", daemon=True)

    def start(self) -> SliceCpuSampler:
        self._thread.start()
        return self

    def stop(self) -> list[Snapshot]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.snapshots

    def _run(self) -> None:
        while not self._stop.is_set():
            found = read_slices(self.cgroup)
            left = follow_left(found, self._seen)
            self.snapshots.append(Snapshot(time.time(), found + left, *host_cpu_s()))
            self._stop.wait(self.interval_s)
