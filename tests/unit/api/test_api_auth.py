"""Token file and token checks of the operator API."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from libra.api.auth import bearer, read_token, token_ok, write_token
from libra.config.checks_api import is_loopback


def test_token_file_is_private_and_new_each_time(tmp_path: Path) -> None:
    (tmp_path / "api_token").write_text("old\n")
    os.chmod(tmp_path / "api_token", 0o644)
    first = write_token(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / "api_token").st_mode) == 0o600
    assert read_token(tmp_path) == first and len(first) >= 32
    assert write_token(tmp_path) != first


TOKEN = "s3cret-token"
CHECKS = [
    ("right", bearer(TOKEN), True),
    ("wrong", bearer("other"), False),
    ("missing", (), False),
    ("none", None, False),
    ("no-scheme", (("authorization", TOKEN),), False),
    ("other-key", (("x-token", "Bearer " + TOKEN),), False),
    ("prefix-only", bearer(TOKEN[:-1]), False),
    ("bytes-value", (("authorization", b"Bearer " + TOKEN.encode()),), False),
]


@pytest.mark.parametrize(("metadata", "ok"), [c[1:] for c in CHECKS], ids=[c[0] for c in CHECKS])
def test_token_check(metadata: object, ok: bool) -> None:
    assert token_ok(TOKEN, metadata) is ok  # type: ignore[arg-type]


@pytest.mark.parametrize(("address", "loopback"), [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                                  ("localhost", True), ("0.0.0.0", False), ("10.1.2.3", False),
                                                  ("::", False), ("example.org", False)])
def test_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback
