"""planner/sim is as pure as the rest of the planner: stdlib, numpy, scipy and planner only."""

from __future__ import annotations

import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SIM = os.path.join(ROOT, "planner", "sim")


@pytest.mark.parametrize("module", sorted(f for f in os.listdir(SIM) if f.endswith(".py")))
def test_sim_imports_only_the_planner_stdlib_numpy_scipy(module: str) -> None:
    with open(os.path.join(SIM, module), encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    bad = {r for r in roots if r not in ("planner", "numpy", "scipy") and r not in sys.stdlib_module_names}
    assert not bad, f"planner/sim/{module} imports {sorted(bad)}"
