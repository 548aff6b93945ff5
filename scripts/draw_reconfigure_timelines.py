"""Draw the pictures of cluster_manual/elastic_runtime.md from the phase trace of a reconfigure benchmark run:
one picture per strategy (its changes side by side), as `libra trace timeline` draws them.

    python benchmarks/reconfigure.py --out benchmarks/results/reconfigure.json --trace-dir /tmp/reconfigure-trace
    python scripts/draw_reconfigure_timelines.py /tmp/reconfigure-trace --out-dir cluster_manual/images
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from libra.observability.trace_timeline import render_timeline

# picture -> (the reconfigure.change spans it shows, its title)
PICTURES: dict[str, tuple[dict[str, str], str]] = {
    "reconfigure_diff.png": ({"strategy": "diff"}, "diff: start or stop only the difference"),
    "reconfigure_restart_all.png": ({"strategy": "restart_all", "drain": "true"},
                                    "restart_all: stop every instance, then start the target set"),
    "reconfigure_restart_all_abort.png": ({"strategy": "restart_all", "drain": "false"},
                                          "restart_all with runtime_drain_before_reconfigure off: abort and requeue"),
    "reconfigure_blue_green.png": ({"strategy": "blue_green"},
                                   "blue_green: green set on spare GPUs, one serving flip, blue drains"),
    "reconfigure_prewarm.png": ({"strategy": "prewarm"}, "prewarm: standby set loaded ahead, flip on the trigger"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="trace directory written by benchmarks/reconfigure.py --trace-dir")
    parser.add_argument("--out-dir", type=Path, default=Path("cluster_manual/images"))
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    missing = []
    for name, (match, title) in PICTURES.items():
        try:
            info = render_timeline(args.trace, args.out_dir / name, match=match, title=title)
        except ValueError as exc:
            missing.append(f"{name}: {exc}")
            continue
        print(f"wrote {info['output']}: {', '.join(info['columns'])}")
    for problem in missing:
        print(f"not drawn: {problem}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
