"""A Ray temp dir too deep for Ray's Unix socket paths (107 bytes) is reached through a short link that
leads to it, and only then."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from libra.cluster.ray_runtime import AF_UNIX_PATH_MAX, socket_safe_dir

SESSION_SOCKET = "/session_2026-12-01_22-54-30_984217_4194304/sockets/plasma_store"
FITS = AF_UNIX_PATH_MAX - len(SESSION_SOCKET)  # the longest temp dir whose sockets fit


@pytest.fixture
def dir_of_length() -> Iterator[Callable[[int], Path]]:
    """Makes a directory whose absolute path is exactly the given number of characters long."""
    made: list[str] = []

    def make(length: int) -> Path:
        root = tempfile.mkdtemp(prefix="lrt-", dir="/tmp")
        made.append(root)
        path = Path(root) / ("d" * (length - len(root) - 1))
        path.mkdir()
        assert len(str(path)) == length
        return path

    yield make
    for root in made:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(("length", "reserve", "linked"), [
    (24, "", False),
    (FITS, "", False),
    (FITS + 1, "", True),
    (FITS, "/ray", True),
    (200, "", True),
], ids=["short", "at-the-limit", "one-over", "reserve-pushes-over", "deep-run-directory"])
def test_a_dir_is_linked_only_when_sockets_would_not_fit(dir_of_length: Callable[[int], Path], length: int,
                                                         reserve: str, linked: bool) -> None:
    target = dir_of_length(length)
    used, link_dir = socket_safe_dir(str(target), reserve=reserve)
    try:
        assert (link_dir is not None) is linked
        assert len(os.fsencode(used + reserve + SESSION_SOCKET)) <= AF_UNIX_PATH_MAX
        (Path(used) / "written-through").write_text("x")
        assert (target / "written-through").read_text() == "x"
        assert link_dir is None or Path(used).parent == Path(link_dir)
    finally:
        if link_dir is not None:
            shutil.rmtree(link_dir)
    assert target.is_dir(), "removing the link's folder must leave the real temp dir alone"
