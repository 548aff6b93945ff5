"""The server forker (`libra.rollout.server_forker`, asked through `forker_client`) with real processes and a
small probe module in place of vLLM's server: a forked server runs with the modules the forker imported, the
request's environment exactly (not the forker's), its own session and log, the command lines a started guard and
server show, and under a guard that reports its exit and stops it when its owner is gone; servers that differ
only in their placement share one forker, which ends with the process that started it while its servers run on.
A forker that cannot start is a `ForkerUnavailable`, and `ServerProcess.start` then starts a new interpreter."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from libra.proc_stat import pid_alive, process_start_ticks
from libra.rollout import forker_client, server
from libra.rollout.forker_client import ForkerUnavailable, ask, fork_server, socket_path
from libra.rollout.server import ServerLaunch, ServerProcess
from libra.rollout.server_forker import start_lock

PROBE = """
import json, os, sys, time
out, mode = sys.argv[1], sys.argv[2]
report = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid(),
          "pgid": os.getpgrp(), "preimported": "libra_probe_marker" in sys.modules}
with open(out + ".tmp", "w") as fh:
    json.dump(report, fh)
os.replace(out + ".tmp", out)
print("probe server running", flush=True)
if mode == "exit":
    sys.exit(3)
time.sleep(600)
"""


def wait_until(check: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"{what} within {within_s}s"
        time.sleep(0.05)


@pytest.fixture
def probe_dir(tmp_path: Path) -> Path:
    (tmp_path / "libra_probe_server.py").write_text(textwrap.dedent(PROBE))
    (tmp_path / "libra_probe_marker.py").write_text("IMPORTED = True\n")
    (tmp_path / "logs").mkdir()
    return tmp_path


@pytest.fixture
def started() -> Iterator[list[int]]:
    """Guards (with their process groups) and forkers a test started: all killed after it, whatever its
    outcome."""
    groups: list[int] = []
    yield groups
    for pid in groups:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            try:
                os.kill(pid, signal.SIGKILL)  # not a group leader (a forker)
            except ProcessLookupError:
                pass
    for path, process in list(forker_client._started.items()):
        process.kill()
        process.wait()
        del forker_client._started[path]


def base_env(probe_dir: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(probe_dir), "SHARED": "job-wide"}


def start_probe(probe_dir: Path, started: list[int], name: str, env: dict[str, str], mode: str = "run",
                owner_pid: int = 0) -> tuple[int, Path, Path]:
    out, log = probe_dir / f"{name}.json", probe_dir / "logs" / f"{name}.log"
    command = [sys.executable, "-m", "libra_probe_server", str(out), mode]
    guard = [sys.executable, "-m", "libra.rollout.server_guard", "--owner-pid", str(owner_pid), "--"]
    with open(log, "ab") as fh:
        pid = fork_server("libra_probe_server", command[3:], env, fh.fileno(), owner_pid,
                          process_start_ticks(owner_pid) if owner_pid else 0, " ".join(guard + command),
                          " ".join(command), str(probe_dir / "logs"), str(probe_dir / "logs" / "forker.log"),
                          ["libra_probe_marker"], timeout_s=60)
    started.append(pid)
    return pid, out, log


def report(out: Path) -> dict[str, Any]:
    wait_until(out.exists, 30, f"{out.name} written by the forked server")
    return dict(json.loads(out.read_text()))


def test_forked_servers_run_with_their_own_environment_session_and_command_line(
        probe_dir: Path, started: list[int]) -> None:
    # as on two host actors of a job: the second on a worker Ray started for the job, the first ahead of it
    first_env = {**base_env(probe_dir), "CUDA_VISIBLE_DEVICES": "0", "VLLM_CPU_OMP_THREADS_BIND": "0",
                 "RAY_JOB_ID": "ffffffff"}
    second_env = {**base_env(probe_dir), "CUDA_VISIBLE_DEVICES": "1", "RAY_JOB_ID": "01000000"}
    guards, reports = [], []
    for name, env in (("first", first_env), ("second", second_env)):
        guard, out, _log = start_probe(probe_dir, started, name, env)
        guards.append(guard)
        reports.append(report(out))
    forker_pid = ask(socket_path(str(probe_dir / "logs"), first_env), {"ping": True})["pid"]
    assert forker_pid == ask(socket_path(str(probe_dir / "logs"), second_env), {"ping": True})["pid"], \
        "servers that differ only in their placement share a forker"
    for guard, env, seen in zip(guards, (first_env, second_env), reports, strict=True):
        assert seen["preimported"], "the server runs with the modules the forker imported"
        assert {k: v for k, v in seen["env"].items() if k in env} == env
        assert set(seen["env"]) - set(env) <= {"PWD"}, "the request's environment, not the forker's"
        assert seen["cwd"] == os.getcwd() and seen["pgid"] == guard, "its guard leads its process group"
        assert psutil.Process(guard).ppid() == forker_pid
        guard_line = psutil.Process(guard).cmdline()
        assert guard_line[1:3] == ["-m", "libra.rollout.server_guard"] and "libra_probe_server" in guard_line
        assert psutil.Process(seen["pid"]).cmdline()[1:3] == ["-m", "libra_probe_server"]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in reports[1]["env"]


def test_the_guard_reports_the_exit_and_clears_the_group(probe_dir: Path, started: list[int]) -> None:
    guard, out, log = start_probe(probe_dir, started, "exits", base_env(probe_dir), mode="exit")
    report(out)
    wait_until(lambda: not pid_alive(guard), 30, "the guard ends with its server")
    text = log.read_text()
    assert f"guard {guard} forked by the server forker" in text and "probe server running" in text
    assert "[libra server guard] server exited with code 3" in text


def test_a_forked_server_stops_when_its_owner_is_gone(probe_dir: Path, started: list[int]) -> None:
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        guard, out, log = start_probe(probe_dir, started, "owned", base_env(probe_dir), owner_pid=owner.pid)
        server_pid = report(out)["pid"]
        assert pid_alive(server_pid)
    finally:
        owner.kill()
        owner.wait()
    wait_until(lambda: not pid_alive(guard) and not pid_alive(server_pid), 30, "the server stopped with its owner")
    assert f"owner process {owner.pid} is gone; server stopped" in log.read_text()


def test_the_forker_ends_with_its_starter_and_its_servers_run_on(probe_dir: Path, started: list[int]) -> None:
    logs, env = probe_dir / "logs", base_env(probe_dir)
    starter = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import json, sys
        from libra.rollout.forker_client import ask, ensure_forker, socket_path
        path = socket_path({str(logs)!r}, {env!r})
        ensure_forker(path, {env!r}, {str(logs / 'forker.log')!r}, ["libra_probe_marker"], 60)
        print(ask(path, {{"ping": True}})["pid"])
        """)], capture_output=True, text=True, timeout=120, check=True)
    forker_pid = int(starter.stdout.split()[-1])
    started.append(forker_pid)  # its own group (the starter's, which is gone): killed after the test if left
    wait_until(lambda: not pid_alive(forker_pid), 30, "the forker exited after its starter")
    assert "is gone; exiting" in (logs / "forker.log").read_text()
    path = socket_path(str(logs), env)
    assert not os.path.exists(path) and not os.path.exists(path + ".lock"), "an ended forker leaves no file"
    guard, out, _log = start_probe(probe_dir, started, "after", env)  # a new forker, started by this process
    server_pid = report(out)["pid"]
    forker_client._started.pop(socket_path(str(logs), env)).kill()
    time.sleep(2)
    assert pid_alive(guard) and pid_alive(server_pid), "a forker's servers do not end with it"


def test_a_start_lock_whose_file_was_removed_is_taken_again_on_the_new_file(tmp_path: Path) -> None:
    """What an ending forker does (remove the lock file while holding it) leaves a waiting starter holding the
    lock on the file the next starter opens, not on the removed one."""
    path = str(tmp_path / "forker.sock")
    seen: list[tuple[bool, bool]] = []

    def next_starter() -> None:
        with start_lock(path):
            fd = os.open(path + ".lock", os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                excludes = False
            except BlockingIOError:
                excludes = True
            finally:
                os.close(fd)
            seen.append((os.path.exists(path + ".lock"), excludes))

    with start_lock(path):
        waiting = threading.Thread(target=next_starter)
        waiting.start()
        time.sleep(0.3)
        assert seen == [], "the lock is held"
        os.unlink(path + ".lock")
    waiting.join(10)
    assert seen == [(True, True)], "the waiting starter holds the lock on the file a later starter opens"


def dead_socket(path: Path) -> None:
    """What a killed forker leaves: a socket file nobody listens on."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))


def test_a_sweep_removes_what_killed_forkers_left_and_nothing_else(tmp_path: Path) -> None:
    folder = tmp_path / "forkers"
    folder.mkdir()
    killed, lone_socket, lone_lock = folder / "killed.sock", folder / "lone.sock", folder / "lone-lock.sock"
    live, starting = folder / "live.sock", folder / "starting.sock"
    dead_socket(killed)
    Path(f"{killed}.lock").write_text("")
    dead_socket(lone_socket)
    Path(f"{lone_lock}.lock").write_text("")
    dead_socket(starting)  # bound, not yet listening, while its starter holds the lock
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener, start_lock(str(starting)):
        listener.bind(str(live))
        listener.listen(1)
        Path(f"{live}.lock").write_text("")
        removed = forker_client.sweep_killed_forkers(str(folder))
    assert removed == sorted(map(str, (killed, lone_lock, lone_socket)))
    assert sorted(p.name for p in folder.iterdir()) == ["live.sock", "live.sock.lock", "starting.sock",
                                                          "starting.sock.lock"]
    assert forker_client.sweep_killed_forkers(str(tmp_path / "missing")) == []


def test_a_forker_that_cannot_start_is_unavailable(probe_dir: Path, started: list[int]) -> None:
    env = base_env(probe_dir)
    path = socket_path(str(probe_dir / "logs"), env)
    with pytest.raises(ForkerUnavailable, match="exited with code 1 before serving"):
        forker_client.ensure_forker(path, env, str(probe_dir / "logs" / "forker.log"), ["no_such_module_here"], 60)
    assert "No module named 'no_such_module_here'" in (probe_dir / "logs" / "forker.log").read_text()


def made_as(kind: str, path: Path) -> None:
    if kind == "own-closed":
        path.mkdir(mode=0o700)
    elif kind == "own-open":
        path.mkdir()
        path.chmod(0o755)
    elif kind == "link":
        (path.parent / "real").mkdir(mode=0o700)
        path.symlink_to(path.parent / "real")
    elif kind == "file":
        path.write_text("")
    elif kind == "another-user":
        if os.getuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        path.mkdir(mode=0o700)
        os.chown(path, 4242, 4242)


@pytest.mark.parametrize(("kind", "usable"), [
    ("missing", True), ("own-closed", True), ("own-open", False), ("link", False), ("file", False),
    ("another-user", False),
])
def test_the_socket_folder_is_this_users_alone(tmp_path: Path, kind: str, usable: bool) -> None:
    path = tmp_path / "libra-forker"
    made_as(kind, path)
    if usable:
        forker_client.private_dir(str(path))
        info = path.lstat()
        assert path.is_dir() and info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700
    else:
        with pytest.raises(ForkerUnavailable, match=f"the server forker's folder {path} is a .* remove it"):
            forker_client.private_dir(str(path))


BASE = {"PATH": "/usr/bin", "RAY_RAYLET_PID": "100", "TORCH_COMPILE_DISABLE": "1"}


@pytest.mark.parametrize(("other", "shared"), [
    ({**BASE, "CUDA_VISIBLE_DEVICES": "3"}, True),
    ({**BASE, "VLLM_CPU_OMP_THREADS_BIND": "4-5"}, True),
    ({**BASE, "RAY_JOB_ID": "ffffffff"}, True),
    ({**BASE, "SPT_NOENV": "1"}, True),
    ({**BASE, "TORCH_COMPILE_DISABLE": "0"}, False),
    ({**BASE, "RAY_RAYLET_PID": "200"}, False),
    ({**BASE, "VLLM_USE_V1": "1"}, False),
    ({k: v for k, v in BASE.items() if k != "PATH"}, False),
], ids=["placement", "cores", "placeholder-job-id", "title-setting", "import-read-variable", "other-node",
        "variable-added", "variable-removed"])
def test_which_environments_share_a_forker(other: dict[str, str], shared: bool) -> None:
    first = {**BASE, "CUDA_VISIBLE_DEVICES": "0", "RAY_JOB_ID": "01000000"}
    assert (forker_client.import_env_key(first) == forker_client.import_env_key(other)) is shared
    assert (socket_path("/job/logs", first) == socket_path("/job/logs", other)) is shared
    assert socket_path("/job/logs", first) != socket_path("/other-job/logs", first)


def test_server_process_starts_a_new_interpreter_when_no_forker_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(The process start itself is replaced: a vLLM server cannot start in a unit test.)"""
    popened: list[list[str]] = []

    class RecordedStart:
        pid = 4242

        def __init__(self, command: list[str], **kwargs: object) -> None:
            popened.append(command)

    def unavailable(*args: object, **kwargs: object) -> int:
        raise ForkerUnavailable("no server forker answers at /x.sock: refused")

    monkeypatch.setattr(forker_client, "fork_server", unavailable)
    monkeypatch.setattr(subprocess, "Popen", RecordedStart)
    log = tmp_path / "s.log"
    launch = ServerLaunch(model_path="/m", port=8000, host="127.0.0.1", max_model_len=64, kv_cache_bytes=0,
                          log_path=str(log))
    assert server.uses_forker(launch, "cpu")
    process = ServerProcess.start(launch, ["0"], "cpu")
    assert process.pid == 4242 and len(popened) == 1
    assert "no server forker answers at /x.sock: refused; starting the server in a new interpreter" in log.read_text()


@pytest.mark.parametrize(("changes", "device", "env", "forked"), [
    ({}, "cpu", {}, True),
    ({}, "cpu", {"LIBRA_SERVER_FORKER": "1"}, True),
    ({}, "cpu", {"LIBRA_SERVER_FORKER": "0"}, False),
    ({"fork_from_forker": False}, "cpu", {}, False),
    ({"fork_engine_core": False}, "cpu", {}, False),
    ({"tp_size": 2}, "cpu", {}, False),
    ({}, "cuda", {}, False),
], ids=["tp1-cpu", "tp1-cpu-env-on", "env-off", "launch-off", "spawned-engine-core", "tp2-cpu", "cuda"])
def test_which_servers_are_forked_from_the_forker(changes: dict[str, Any], device: str, env: dict[str, str],
                                                  forked: bool) -> None:
    launch = ServerLaunch(model_path="/m", port=8000, host="127.0.0.1", max_model_len=64, kv_cache_bytes=0, **changes)
    assert server.uses_forker(launch, device, env) is forked


@pytest.mark.parametrize(("payload", "error"), [
    (b"not json\n", "unreadable request"),
    (b"[1, 2]\n", "not a JSON object"),
    (b'{"module": "libra_probe_server", "args": []}\n', "carries the log file's descriptor only, got 0"),
    (b'{"module": "libra_probe_server"', "unreadable request: request not ended by a newline"),
], ids=["not-json", "not-an-object", "no-log-descriptor", "cut-short"])
def test_a_bad_request_is_answered_with_an_error_and_the_forker_serves_on(
        probe_dir: Path, started: list[int], payload: bytes, error: str) -> None:
    import socket as sockets

    env = base_env(probe_dir)
    path = socket_path(str(probe_dir / "logs"), env)
    forker_client.ensure_forker(path, env, str(probe_dir / "logs" / "forker.log"), ["libra_probe_marker"], 60)
    forker_pid = ask(path, {"ping": True})["pid"]
    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(payload)
        sock.shutdown(sockets.SHUT_WR)
        reply = json.loads(sock.makefile("rb").readline())
    assert error in reply["error"]
    assert ask(path, {"ping": True})["pid"] == forker_pid, "the same forker answers the next request"
