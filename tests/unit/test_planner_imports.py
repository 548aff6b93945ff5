"""The planner is a pure library: it imports only the standard library, numpy and scipy.

Checked twice: statically (every import statement of every module under planner/, subpackages such as
planner/sim included) and dynamically (importing every planner module in a fresh interpreter pulls in no
forbidden package).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLANNER = os.path.join(ROOT, "planner")
FORBIDDEN = ("libra", "ray", "torch", "vllm", "megatron", "transformers")
ALLOWED_THIRD_PARTY = ("numpy", "scipy")


def planner_modules() -> list[str]:
    """Every module under planner/, subpackages (planner/sim) included, as paths relative to planner/."""
    return sorted(os.path.relpath(os.path.join(folder, f), PLANNER)
                  for folder, _, files in os.walk(PLANNER) for f in files if f.endswith(".py"))


def imported_roots(path: str) -> set[str]:
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), filename=path)
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("module", planner_modules())
def test_every_import_is_stdlib_numpy_scipy_or_planner(module: str) -> None:
    roots = imported_roots(os.path.join(PLANNER, module))
    bad = {r for r in roots
           if r != "planner" and r not in ALLOWED_THIRD_PARTY and r not in sys.stdlib_module_names}
    assert not bad, f"planner/{module} imports {sorted(bad)}"
    assert not roots & set(FORBIDDEN)


def test_importing_the_planner_loads_no_forbidden_package() -> None:
    names = ["planner." + m[:-3].replace(os.sep, ".").removesuffix(".__init__") for m in planner_modules()
             if m != "__init__.py"]
    code = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    leaked = sorted(m for m in loaded if m.split(".")[0] in FORBIDDEN)
    assert not leaked, f"importing planner loaded {leaked[:10]}"
    assert "planner.search" in loaded
