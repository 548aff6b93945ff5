"""Shared pytest set-up: GPU-marked tests are skipped where no CUDA device exists; `tmpfs_disk` makes small
size-limited file systems for the disk-full cases."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu_items:
        item.add_marker(skip_gpu)


@pytest.fixture
def tmpfs_disk(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """`tmpfs_disk(size)` mounts a fresh tmpfs of `size` ("64k", "64m") under the test's tmp_path and returns
    it; every mount is undone at teardown. Mounting needs root: elsewhere the test is skipped, saying why."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        path = tmp_path / f"disk-{len(mounts)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a size-limited tmpfs here ({done.stderr.strip() or done.returncode})")
        mounts.append(path)
        return path

    yield mount
    for path in reversed(mounts):
        subprocess.run(["umount", "-l", str(path)], check=False)
