"""Holds a local Ray cluster for the adoption test: a cluster that outlives the controllers that join it
(as a real cluster does). Prints the address as one JSON line, then waits until stdin closes or SIGTERM."""

from __future__ import annotations

import json
import signal
import sys
import threading

from libra.cluster.ray_runtime import RayRuntime


def main() -> None:
    gpus, tmp_dir = int(sys.argv[1]), sys.argv[2]
    runtime = RayRuntime.start(num_gpus=gpus, num_cpus=4 * gpus, tmp_dir=tmp_dir, namespace="libra-holder")
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print(json.dumps({"address": runtime.address}), flush=True)
    done.wait()
    runtime.shutdown()


if __name__ == "__main__":
    main()
