"""A node's pre-imported server starter: one process that imports vLLM's OpenAI server once and forks every
TP-1 CPU server of its job on that node from there, guarded as `server_guard` guards a started one.

    python -m libra.rollout.server_forker < settings (one line of JSON: socket, owner_pid, modules)

Importing vLLM's server is most of a TP-1 CPU server's start (about 12 of 14 CPU-s on this project's 2-core
machines, `benchmarks/server_start.py`), paid again by every start: a second instance, a replacement, a
reconfiguration, a restart reload. A server forked from this process starts with those modules loaded.

Each request (one line of JSON on the Unix socket, with the server's log file passed as a descriptor) is
answered with the pid of a new guard: forked from here, it leads its own session, takes the request's
environment and working directory, writes to the log, shows the command line a started guard would show, and
forks the server (which runs the module named in the request, its modules already imported) as `server_guard`
runs one, stopping it when the request's owner (the host that asked) is gone. The guards are not this process's
to keep: they outlive it, and this process ends when its owner (the host that started it) does: Ray kills it
with that host, and when it ends on its own it removes its socket and the lock its starters took (`start_lock`;
`forker_client.sweep_killed_forkers` removes a killed forker's).

Why a fork is safe here: this process runs no model and no thread of its own (what vLLM's API server already is
when it forks a TP-1 engine core, `forked_engine_main`), and the server applies its own environment before
vLLM reads it (vLLM reads its variables when used; the variables read at import are the same for every server
this process serves, see `forker_client.import_env_key`).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import traceback
from collections.abc import Iterator
from typing import Any

from libra import proc_stat
from libra.rollout import server_guard

ACCEPT_POLL_S = 1.0
MAX_REQUEST_BYTES = 4 * 2**20


def exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def run_server(module: str, args: list[str], title: str | None) -> int:
    """In the server's process: run `module` as `python -m module args` would; returns its exit status."""
    server_guard.stop_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    set_title(title)
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as exc:
        return exit_status(exc)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        return 1


def set_title(title: str | None) -> None:
    """The command line `ps` and /proc show for this process (what a started process with it would show); None
    keeps the current one. The first call lays out the memory titles use: made in the forker, before a server's
    environment (which may hold `SPT_NOENV`, see `forker_client`) applies, a forked title can be as long as a
    started command line."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(setproctitle.getproctitle() if title is None else title)


def finish(code: int) -> None:
    """End a forked process as an interpreter would end (exit handlers, flushed output), without returning into
    the code it was forked from."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def become_guard(request: dict[str, Any], log_fd: int) -> None:
    """In the forked guard: take the request's session, files and environment, then guard its server."""
    code = 1
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(devnull)
        os.close(log_fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        print(f"[libra server forker] guard {os.getpid()} forked by the server forker (pid {os.getppid()}), "
              "which imported the server's modules", flush=True)
        set_title(request.get("guard_title"))
        owner_pid, owner_ticks = int(request["owner_pid"]), int(request.get("owner_start_ticks", 0))
        owner_gone = (lambda: not proc_stat.pid_alive(owner_pid, owner_ticks)) if owner_pid else None

        def fork_server() -> server_guard.ForkedChild:
            pid = os.fork()
            if pid == 0:
                finish(run_server(request["module"], list(request["args"]), request.get("server_title")))
            return server_guard.ForkedChild(pid)

        code = server_guard.guard(fork_server, owner_pid, owner_gone)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def reap_guards() -> None:
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One request: a line of JSON (an object), and the descriptors sent with its first bytes."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 65536, 4)
    try:
        chunks = [data]
        while not chunks[-1].endswith(b"\n"):
            more = conn.recv(65536)
            if not more or sum(len(c) for c in chunks) > MAX_REQUEST_BYTES:
                raise ValueError("request not ended by a newline")
            chunks.append(more)
        request = json.loads(b"".join(chunks))
        if not isinstance(request, dict):
            raise ValueError(f"request is not a JSON object: {request!r:.80}")
    except (OSError, ValueError):
        for fd in fds:
            os.close(fd)
        raise
    return request, list(fds)


def answer(conn: socket.socket, reply: dict[str, Any]) -> None:
    conn.sendall(json.dumps(reply).encode() + b"\n")


def handle(conn: socket.socket, listener: socket.socket) -> None:
    try:
        request, fds = read_request(conn)
    except (OSError, ValueError) as exc:
        answer(conn, {"error": f"unreadable request: {exc}"})
        return
    if request.get("ping"):
        for fd in fds:
            os.close(fd)
        answer(conn, {"pid": os.getpid()})
        return
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        answer(conn, {"error": f"a start request carries the log file's descriptor only, got {len(fds)}"})
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        conn.close()
        become_guard(request, fds[0])
    os.close(fds[0])
    try:
        answer(conn, {"pid": pid})
    except OSError:
        # the asker is gone (it gave up waiting and starts the server itself): nobody would know this server
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            os.kill(pid, signal.SIGKILL)  # not yet the leader of its session
        raise


@contextlib.contextmanager
def start_lock(socket_path: str, wait: bool = True) -> Iterator[bool]:
    """Held while a forker for `socket_path` is started, and while an ending forker's files are removed: a file
    beside the socket, taken again when the file it was taken on was removed meanwhile (by whoever held it to
    remove it), so a lock is never held on a file nobody else can open. Yields whether it is held: always when
    `wait`, else False at once when someone else holds it."""
    lock_path = socket_path + ".lock"
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                current = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                yield True
                return
        finally:
            os.close(fd)


def remove_files(socket_path: str, socket_inode: int) -> None:
    """An ending forker's socket and start lock, unless a forker started after it serves at that path."""
    with start_lock(socket_path):
        try:
            if os.stat(socket_path).st_ino != socket_inode:
                return
            os.unlink(socket_path)
        except FileNotFoundError:
            pass
        os.unlink(socket_path + ".lock")


def serve(socket_path: str, owner_pid: int, modules: list[str]) -> int:
    for module in modules:
        importlib.import_module(module)
    set_title(None)
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    socket_inode = os.stat(socket_path).st_ino
    listener.listen(16)
    listener.settimeout(ACCEPT_POLL_S)
    print(f"[libra server forker] pid {os.getpid()} serves {socket_path} (imported: {', '.join(modules)})",
          flush=True)
    try:
        while not owner_pid or os.getppid() == owner_pid:
            reap_guards()
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(30.0)
                try:
                    handle(conn, listener)
                except OSError as exc:
                    print(f"[libra server forker] request failed: {exc}", file=sys.stderr, flush=True)
    finally:
        listener.close()
        remove_files(socket_path, socket_inode)
    print(f"[libra server forker] owner {owner_pid} is gone; exiting", flush=True)
    return 0


def main() -> int:
    """Reads its settings as one line of JSON on stdin (`socket`, `owner_pid`, `modules`): the command line
    stays as short as it can be, since a forked process shows its own in the memory that line had (a shorter
    title than that line leaves empty arguments at the end)."""
    settings = json.loads(sys.stdin.readline())
    return serve(str(settings["socket"]), int(settings.get("owner_pid", 0)), [str(m) for m in settings["modules"]])


if __name__ == "__main__":
    sys.exit(main())
