"""A local Ray cluster starts in a temp dir deeper than its Unix sockets allow (a run directory or a test's
tmp path can be), and the short link it is reached through goes when the cluster stops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
HOLDER = REPO / "tests" / "integration" / "controller" / "ray_holder.py"


def test_ray_starts_in_a_deep_temp_dir_and_leaves_no_link(tmp_path: Path) -> None:
    deep = tmp_path / ("run-directory-" * 6) / "ray"
    deep.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, str(HOLDER), "1", str(deep)], cwd=REPO, text=True,
                              env=dict(os.environ, RAY_AUTH_MODE="disabled"), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        line = holder.stdout.readline()
        assert line, f"the holder printed no address; stderr:\n{holder.stderr.read() if holder.stderr else ''}"
        assert json.loads(line)["address"]
        sessions = [p for p in deep.iterdir() if p.name.startswith("session_2")]
        assert sessions, f"Ray's session files are not in {deep}: {list(deep.iterdir())}"
        links = [p for p in Path("/tmp").glob("lr-*/r") if p.resolve() == deep.resolve()]
        assert len(links) == 1
        holder.stdin.close()
        assert holder.wait(timeout=120) == 0
        assert not links[0].parent.exists(), "the short link's folder outlived the cluster"
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, 9)
            holder.wait(timeout=30)
