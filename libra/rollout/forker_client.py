"""Asking this node's server forker (`server_forker`) of a job for a server, and starting the forker when none
answers.

One forker serves a job's servers on a node that share the environment vLLM and torch read while they are
imported (`import_env_key`: everything but the variables that place one server, read when it runs); its socket
lives in the node's temporary directory, named after the Python, the job's server log folder and that key. The
host that finds none starts it, under a file lock (`server_forker.start_lock`), so hosts that start servers
together wait for one import instead of each paying for its own; the forker ends with that host (removing its
socket and lock file when it can; a host that starts a forker first removes what killed ones left, see
`sweep_killed_forkers`). Anything that keeps a forker from answering is a `ForkerUnavailable`, on which the caller
starts the server in a new interpreter.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from libra.rollout import server_forker

# the variables that place one server (its logical GPUs and their cores): read when the server runs, not at import
PER_SERVER_ENV = ("CUDA_VISIBLE_DEVICES", "VLLM_CPU_OMP_THREADS_BIND")
# the variables that differ between the host actors of one job on one node and that no import reads: a Ray worker
# started ahead of its first task (Ray starts some when a job's driver connects) keeps a placeholder job id
PER_HOST_ENV = ("RAY_JOB_ID",)
# Ray sets it in its workers: it keeps setproctitle from using the environment's memory, which a forked server's
# command line needs (it is longer than the forker's)
TITLE_ENV = "SPT_NOENV"
FORKER_START_S = 300.0
REQUEST_TIMEOUT_S = 30.0
POLL_S = 0.2

_started: dict[str, subprocess.Popen[bytes]] = {}


class ForkerUnavailable(RuntimeError):
    """No forker answers for this server's job and environment (it failed to start, exited or hangs)."""


def import_env_key(env: Mapping[str, str]) -> str:
    """A digest of the environment a forker imports under: servers whose environments differ only in
    `PER_SERVER_ENV` and `PER_HOST_ENV` share a forker."""
    left_out = {*PER_SERVER_ENV, *PER_HOST_ENV, TITLE_ENV}
    kept = sorted((k, v) for k, v in env.items() if k not in left_out)
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()[:16]


def socket_path(job_dir: str, env: Mapping[str, str]) -> str:
    """Where the forker of the job whose server logs are in `job_dir` serves servers with environment `env`, on
    this node (a Unix socket's path must stay short, so it is a digest under the temporary directory)."""
    key = hashlib.sha256(f"{sys.executable}\0{os.path.realpath(job_dir)}\0{import_env_key(env)}".encode())
    return os.path.join(tempfile.gettempdir(), f"libra-forker-{os.getuid()}", key.hexdigest()[:24] + ".sock")


def private_dir(path: str) -> None:
    """Make `path` (this user's folder of forker sockets) when missing, and make sure it is a folder this user
    owns that nobody else may enter: in a temporary directory shared with other users, someone else could have
    made it first and answer in the forker's place (and read the environment of every server it is asked for).
    ForkerUnavailable when it is not."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ForkerUnavailable(f"cannot make the server forker's folder {path}: {exc}") from exc
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        kind = "folder" if stat.S_ISDIR(info.st_mode) else "link" if stat.S_ISLNK(info.st_mode) else "file"
        raise ForkerUnavailable(
            f"the server forker's folder {path} is a {kind} of user {info.st_uid} with mode "
            f"{stat.S_IMODE(info.st_mode):o}, not a folder of user {os.getuid()} closed to others (mode 700): "
            "remove it, or find out who made it")


def ask(path: str, message: Mapping[str, object], fds: Sequence[int] = (), timeout_s: float = REQUEST_TIMEOUT_S
        ) -> dict[str, object]:
    """Send one request to the forker at `path` and return its answer; ForkerUnavailable when none answers."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            socket.send_fds(sock, [json.dumps(message).encode() + b"\n"], list(fds))
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
    except OSError as exc:
        raise ForkerUnavailable(f"no server forker answers at {path}: {exc}") from exc
    try:
        answer = json.loads(reply)
    except ValueError as exc:
        raise ForkerUnavailable(f"the server forker at {path} answered {reply[:200]!r}") from exc
    if not isinstance(answer, dict):
        raise ForkerUnavailable(f"the server forker at {path} answered {answer!r}")
    return answer


def answers(path: str) -> bool:
    try:
        return "pid" in ask(path, {"ping": True}, timeout_s=5.0)
    except ForkerUnavailable:
        return False


def listens(path: str) -> bool:
    """Whether a process listens on the Unix socket at `path` (a forker, answering or not): anything but a
    refused connection or a missing socket is someone there. Asked with a ping, so a forker logs no unreadable
    request."""
    try:
        ask(path, {"ping": True}, timeout_s=1.0)
    except ForkerUnavailable as exc:
        return not isinstance(exc.__cause__, (ConnectionRefusedError, FileNotFoundError))
    return True


def sweep_killed_forkers(folder: str) -> list[str]:
    """Remove what forkers that were killed left in `folder` (a forker ends with the host that started it, and
    Ray kills a host's child processes when the host ends, so most never remove their own files): each socket
    nobody listens on, with its lock file, under that lock taken without waiting (a lock someone holds is a
    forker being started there). Returns the socket paths whose files were removed."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    removed = []
    for path in sorted({os.path.join(folder, n.removesuffix(".lock")) for n in names if ".sock" in n}):
        with server_forker.start_lock(path, wait=False) as held:
            if not held or listens(path):
                continue
            for leftover in (path, path + ".lock"):
                try:
                    os.unlink(leftover)
                except FileNotFoundError:
                    pass
            removed.append(path)
    return removed


def ensure_forker(path: str, env: Mapping[str, str], log_path: str, modules: Sequence[str],
                  timeout_s: float = FORKER_START_S) -> None:
    """Make sure a forker answers at `path`: start one (importing `modules`, writing to `log_path`) when none
    does, and wait until it answers; ForkerUnavailable when it exits or does not answer within `timeout_s`."""
    private_dir(os.path.dirname(path))
    with server_forker.start_lock(path):
        if answers(path):
            return
        sweep_killed_forkers(os.path.dirname(path))
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        with open(log_path, "ab") as log:
            process = subprocess.Popen([sys.executable, "-m", server_forker.__name__], stdin=subprocess.PIPE,
                                       stdout=log, stderr=subprocess.STDOUT, close_fds=True,
                                       env={k: v for k, v in env.items() if k != TITLE_ENV})
        _started[path] = process
        assert process.stdin is not None
        settings = {"socket": path, "owner_pid": os.getpid(), "modules": list(modules)}
        try:
            process.stdin.write(json.dumps(settings).encode() + b"\n")
            process.stdin.close()
        except BrokenPipeError:
            pass  # it exited at once: reported below
        deadline = time.monotonic() + timeout_s
        while not answers(path):
            code = process.poll()
            if code is not None:
                raise ForkerUnavailable(f"the server forker exited with code {code} before serving; log {log_path}")
            if time.monotonic() > deadline:
                process.kill()
                raise ForkerUnavailable(f"the server forker did not serve within {timeout_s:.0f}s (killed); "
                                        f"log {log_path}")
            time.sleep(POLL_S)


def fork_server(module: str, args: Sequence[str], env: Mapping[str, str], log_fd: int, owner_pid: int,
                owner_start_ticks: int, guard_title: str, server_title: str, job_dir: str,
                forker_log_path: str, modules: Sequence[str], timeout_s: float = FORKER_START_S) -> int:
    """Have this node's forker for the job in `job_dir` start a guarded server running `module args` with `env`,
    writing to `log_fd`; returns the guard's pid (the leader of the server's process group)."""
    path = socket_path(job_dir, env)
    ensure_forker(path, env, forker_log_path, modules, timeout_s)
    answer = ask(path, {"module": module, "args": list(args), "env": dict(env), "cwd": os.getcwd(),
                        "owner_pid": owner_pid, "owner_start_ticks": owner_start_ticks,
                        "guard_title": guard_title, "server_title": server_title}, [log_fd])
    pid = answer.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        raise ForkerUnavailable(f"the server forker at {path} did not start the server: {answer.get('error')}")
    return pid
