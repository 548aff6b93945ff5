"""Loads a module of `benchmarks/` (a folder of scripts, not a package) for the tests of its pure parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[3]


def load_benchmark_module(name: str) -> ModuleType:
    """`benchmarks/<name>.py`, imported once under `name` (so its dataclasses pickle and compare)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
