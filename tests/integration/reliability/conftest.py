"""Fixtures of the reliability tests: a fresh workspace per test (job file, run directory, `libra launch` as a
subprocess in its own session), reusing the controller tests' small job; whatever a launch leaves running
is stopped at the end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..controller.conftest import make_workspace, stop_everything


@pytest.fixture
def job_workspace(tmp_path: Path) -> Iterator[dict[str, Any]]:
    ws, launches = make_workspace(tmp_path)
    try:
        yield ws
    finally:
        stop_everything(ws["run_dir"], launches)
