"""A JSON-lines log of the run directory (events, metrics) on a full disk (a small tmpfs filled up; needs
root to mount, skipped otherwise): a line the disk cuts short is taken back, so that after space is freed
every line of the file parses again and nothing written later is glued to half a line."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from libra.run_dir import append_jsonl


@pytest.fixture
def tiny_disk(tmpfs_disk: Callable[[str], Path]) -> Path:
    return tmpfs_disk("64k")


@pytest.mark.parametrize("line_bytes", [1000, 3000, 20000], ids=["quarter-page", "page-sized", "several-pages"])
def test_a_line_cut_by_a_full_disk_is_taken_back(tiny_disk: Path, line_bytes: int) -> None:
    log = tiny_disk / "events.jsonl"
    append_jsonl(log, {"kind": "first"})
    with open(tiny_disk / "filler", "wb", buffering=0) as fh:
        for chunk in (512, 1):  # to the byte
            with pytest.raises(OSError) as full:
                while True:
                    fh.write(b"x" * chunk)
            assert full.value.errno == errno.ENOSPC
    failed = 0
    for i in range(20):
        try:
            append_jsonl(log, {"kind": "during", "i": i, "pad": "y" * line_bytes})
        except OSError:
            failed += 1
    assert failed > 0
    os.unlink(tiny_disk / "filler")
    append_jsonl(log, {"kind": "after"})
    parsed = [json.loads(line) for line in log.read_text().splitlines()]
    assert parsed[0]["kind"] == "first" and parsed[-1]["kind"] == "after"
    assert len(parsed) == 2 + 20 - failed
