"""Phase-trace costs: per-span overhead of the writer, and conversion / summary throughput and peak memory
on a large trace.

    python benchmarks/trace_overhead.py --out benchmarks/results/trace_overhead.json [--spans 1000000]

Costs are CPU time of the process (time.process_time), which stays meaningful on a shared, loaded machine
where wall time mostly measures the other tenants; wall-time figures and the load average are recorded too.

Figures written:
  span_overhead_us            CPU time per `with tracer.span(name, step=i)` in a tight loop, the background
                              writer's serialization and writes included (all of the process's CPU time
                              from the first span until close() returned, divided by the spans)
  span_overhead_attrs_us      the same with two attributes
  span_overhead_wall_us       wall time of the same loop (includes waiting for the CPU on a loaded machine)
  span_hot_path_us            the caller's share alone (writing deferred until after the loop)
  writer_us_per_record        serialization + write per record in the background thread
  disabled_span_us            a span on a disabled tracer
  empty_loop_us               the bare loop, for reference
  convert_spans_per_s         Chrome Trace conversion throughput on the large trace, spans per CPU second
                              of its own process (convert_spans_per_wall_s: per wall second)
  convert_peak_rss_mb         peak RSS of that conversion process; convert_peak_rss_mb_small is the same
                              for a trace 10x smaller and baseline_rss_mb the interpreter with the modules
                              imported, so bounded memory shows as equal peaks
  summary_spans_per_s, summary_peak_rss_mb    the same for `libra trace summary`
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from libra.observability.phase_trace import PhaseTracer  # noqa: E402

T0 = 1_700_000_000_000_000_000


def _loop(tracer: PhaseTracer, n: int, with_attrs: bool, close: bool) -> tuple[float, float]:
    """(CPU us, wall us) per span of a tight loop of spans, the tracer's close() included when asked."""
    wall, cpu = time.perf_counter_ns(), time.process_time_ns()
    if with_attrs:
        for i in range(n):
            with tracer.span("train.forward_backward", step=i, tokens=512, micro_batch=3):
                pass
    else:
        for i in range(n):
            with tracer.span("train.forward_backward", step=i):
                pass
    if close:
        tracer.close()
    return (time.process_time_ns() - cpu) / n / 1000, (time.perf_counter_ns() - wall) / n / 1000


def measure_spans(directory: Path, n: int, repeats: int) -> dict[str, float]:
    results: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        results.setdefault(key, []).append(value)

    for rep in range(repeats):
        for attrs, key in ((False, "span_overhead"), (True, "span_overhead_attrs")):
            tracer = PhaseTracer.open(None, role="train", rank=1000 + 10 * rep + attrs, enabled=True,
                                      trace_dir=directory, env={})
            cpu, wall = _loop(tracer, n, with_attrs=attrs, close=True)
            add(f"{key}_us", cpu)
            add(f"{key}_wall_us", wall)
        deferred = PhaseTracer.open(None, role="train", rank=1100 + rep, enabled=True, trace_dir=directory,
                                    env={}, flush_at=10 * n, flush_interval_s=3600)
        add("span_hot_path_us", _loop(deferred, n, with_attrs=False, close=False)[0])
        cpu = time.process_time_ns()
        deferred.flush()
        add("writer_us_per_record", (time.process_time_ns() - cpu) / n / 1000)
        deferred.close()
        add("disabled_span_us", _loop(PhaseTracer.disabled(), n, with_attrs=False, close=False)[0])
        cpu = time.process_time_ns()
        for _ in range(n):
            pass
        add("empty_loop_us", (time.process_time_ns() - cpu) / n / 1000)
    return {k: round(statistics.median(v), 3) for k, v in results.items()}


def write_trace(directory: Path, spans: int) -> int:
    """An 8-rank trace (4 training ranks, 4 rollout instances) of `spans` spans in the minimal schema, with
    step tags and flows like a real run; returns the bytes written."""
    directory.mkdir(parents=True)
    ranks = [("train", 1000 + r) for r in range(4)] + [("rollout", 2000 + r) for r in range(4)]
    phases = {"train": ["train.recompute_logprobs", "train.forward_backward", "train.optimizer"],
              "rollout": ["rollout.generate", "rollout.reward", "weight_sync.reload"]}
    per_rank = spans // len(ranks)
    total = 0
    for role, rank in ranks:
        lines = []
        names = phases[role]
        with open(directory / f"phase_trace_rank{rank}.jsonl", "w") as handle:
            for i in range(per_rank):
                step = i // 300
                start = T0 + i * 10_000 + rank
                name = names[i % 3]
                attrs = f',"attrs":{{"flow_id":{step}}}' if name == "weight_sync.reload" and i % 300 < 3 else ""
                lines.append(f'{{"schema":1,"name":"{name}","role":"{role}","rank":{rank},"step":{step},'
                             f'"start_ns":{start},"end_ns":{start + 7_001}{attrs}}}\n')
                if len(lines) == 10_000:
                    total += handle.write("".join(lines))
                    lines.clear()
            total += handle.write("".join(lines))
    return total


_CHILD = """
import json, sys, time
from libra.observability import trace_analysis, trace_convert
action, trace, out = sys.argv[1:4]
start, cpu = time.perf_counter(), time.process_time()
if action == "convert":
    count = trace_convert.convert(trace, out).spans
elif action == "summary":
    count = sum(p.count for p in trace_analysis.summarize(trace).phases.values())
else:
    count = 0
seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
# VmHWM is the peak RSS of this process image; getrusage would include the parent's at fork time
hwm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "spans": count,
                  "peak_rss_mb": round(hwm_kb / 1024, 1)}))
"""


def run_child(action: str, trace: Path, out: Path) -> dict[str, Any]:
    """Run one action in a fresh interpreter, which reports its time and peak RSS."""
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", _CHILD, action, str(trace), str(out)],
                          stdout=subprocess.PIPE, env=env, check=True)
    return dict(json.loads(done.stdout))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON result file")
    parser.add_argument("--spans", type=int, default=1_000_000, help="spans in the large conversion trace")
    parser.add_argument("--loop", type=int, default=200_000, help="spans per overhead measurement")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="libra-trace-bench-"))
    try:
        result: dict[str, Any] = {
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                        "load_avg_1m_at_start": round(os.getloadavg()[0], 2)},
            "loop_spans": args.loop,
        }
        result.update(measure_spans(work / "overhead", args.loop, args.repeats))
        large, small = work / "large", work / "small"
        result["trace_spans"] = args.spans
        result["trace_bytes"] = write_trace(large, args.spans)
        write_trace(small, args.spans // 10)
        baseline = run_child("import", large, work / "none")
        conv = run_child("convert", large, work / "trace.json")
        conv_small = run_child("convert", small, work / "small.json")
        summ = run_child("summary", large, work / "none")
        result.update({
            "convert_spans_per_s": round(conv["spans"] / conv["cpu_seconds"]),
            "convert_spans_per_wall_s": round(conv["spans"] / conv["seconds"]),
            "convert_cpu_seconds": round(conv["cpu_seconds"], 2),
            "convert_peak_rss_mb": conv["peak_rss_mb"],
            "convert_peak_rss_mb_small": conv_small["peak_rss_mb"],
            "convert_output_bytes": (work / "trace.json").stat().st_size,
            "baseline_rss_mb": baseline["peak_rss_mb"],
            "summary_spans_per_s": round(summ["spans"] / summ["cpu_seconds"]),
            "summary_peak_rss_mb": summ["peak_rss_mb"],
        })
        if conv["spans"] != (args.spans // 8) * 8:
            raise RuntimeError(f"conversion kept {conv['spans']} of {(args.spans // 8) * 8} spans")
        result["machine"]["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
