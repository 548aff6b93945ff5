"""How fast this machine runs a fixed piece of Python right now: `probe`.

Runs of one split on the metered logical GPUs have differed by 40 % with their slices getting the same CPU
share: the same work took more CPU seconds, so the machine itself ran slower. A probe before and after each
run gives every run a speed figure of its own: a pure-Python loop (the kind of work that sets a tiny model's
decode and training step on these slices: interpreter overhead, not arithmetic), counted per CPU second of the
probing process (`loop_per_cpu_s`: what a core does per second of its time) and per wall second
(`cpu_share`: how much of a core the probe got). A slower core lowers `loop_per_cpu_s`; a busier host lowers
`cpu_share` only.
"""

from __future__ import annotations

import time

CHUNK = 20_000


def probe(seconds: float = 2.0) -> dict[str, float]:
    """Spin a pure-Python loop for `seconds` of wall time in this process; its speed figures."""
    wall_start, cpu_start = time.monotonic(), time.process_time()
    loops = 0
    while time.monotonic() - wall_start < seconds:
        total = 0
        for i in range(CHUNK):
            total += i & 7
        loops += CHUNK
    wall, cpu = time.monotonic() - wall_start, time.process_time() - cpu_start
    return {"loop_per_cpu_s": round(loops / max(cpu, 1e-9)), "cpu_share": round(cpu / wall, 3),
            "seconds": round(wall, 2)}
