"""The operator API's credentials and address in the run directory.

The controller writes a random token to `<run_dir>/api_token`, created with mode 0600 (only the job's owner
can read it), and the address it listens on to `<run_dir>/api_address.json`; the CLI reads both, so a job is
found from its run directory alone. Every call carries the token as `authorization: Bearer <token>`.
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from libra.run_dir import read_json, write_json_atomic

TOKEN_FILE = "api_token"
ADDRESS_FILE = "api_address.json"
METADATA_KEY = "authorization"
SCHEME = "Bearer "


class TokenUnreadable(RuntimeError):
    """The token file is missing or cannot be read (the job is not running, or it belongs to someone else)."""


def write_token(run_root: Path) -> str:
    """A new random token in `<run_root>/api_token`, readable by the owner only."""
    token = secrets.token_urlsafe(32)
    path = run_root / TOKEN_FILE
    path.unlink(missing_ok=True)  # a file left by an earlier controller may have other permissions
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(token + "\n")
    os.chmod(path, 0o600)  # whatever the umask
    return token


def read_token(run_root: Path) -> str:
    path = run_root / TOKEN_FILE
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise TokenUnreadable(f"cannot read the API token {path}: {exc.strerror or exc}; run the command as the "
                              "user who launched the job") from exc


def bearer(token: str) -> tuple[tuple[str, str]]:
    """The call metadata that carries `token`."""
    return ((METADATA_KEY, SCHEME + token),)


def token_ok(expected: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """True when `metadata` carries exactly `expected` (compared in constant time)."""
    for key, value in metadata or ():
        if key == METADATA_KEY and isinstance(value, str) and value.startswith(SCHEME):
            return hmac.compare_digest(value[len(SCHEME):].encode(), expected.encode())
    return False


def connect_host(bind_address: str) -> str:
    """The host a local client dials for a server bound to `bind_address` (a wildcard -> loopback)."""
    if bind_address in ("0.0.0.0", ""):
        return "127.0.0.1"
    if bind_address == "::":
        return "::1"
    return bind_address


def target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def write_address(run_root: Path, bind_address: str, port: int, tls_cert_path: str) -> dict[str, Any]:
    info = {"address": target(connect_host(bind_address), port), "bind_address": bind_address, "port": port,
            "tls": bool(tls_cert_path), "tls_cert_path": tls_cert_path, "pid": os.getpid(),
            "host": socket.gethostname()}
    write_json_atomic(run_root / ADDRESS_FILE, info)
    return info


def read_address(run_root: Path) -> dict[str, Any] | None:
    return read_json(run_root / ADDRESS_FILE)


def remove_files(run_root: Path) -> None:
    for name in (ADDRESS_FILE, TOKEN_FILE):
        (run_root / name).unlink(missing_ok=True)
