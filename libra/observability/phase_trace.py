"""Phase-trace writer: per-process span API that appends schema-v1 records to
`<trace dir>/phase_trace_rank{N}.jsonl` without ever blocking the caller.

The hot path (`span` enter/exit, `instant`, `counter`) reads a monotonic clock and appends a tuple to a
deque; a daemon thread serializes and writes complete lines every `flush_interval_s` or as soon as
`flush_at` records wait. Files are opened O_APPEND and written with whole lines only, so a crash loses at
most the records still in memory plus one partial last line; a file found ending in a partial line gets a
newline before new records so the cut-off line stays the only one lost. Records left in memory are flushed
by `close()`, at interpreter exit, and at the exit of forked `multiprocessing` children.

A forked child keeps its rank and, from its first record on, writes its own file
`phase_trace_rank{N}-pid{P}.jsonl` (children that record nothing leave no file). Timestamps are
Unix epoch nanoseconds taken as `perf_counter_ns() + offset`, so durations are monotonic.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import logging
import math
import multiprocessing.util
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from libra.observability.trace_schema import SCHEMA_VERSION, TRACE_SUBDIR

ENV_ENABLE = "RL_TRAIN_PHASE_TRACE"
ENV_DIR = "RL_TRAIN_PHASE_TRACE_DIR"

_KIND_SPAN, _KIND_INSTANT, _KIND_COUNTER = "span", "instant", "counter"
_perf_ns = time.perf_counter_ns
_thread_state = threading.local()
_UNSET = object()
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()
_WRITE_BATCH = 4096

F = TypeVar("F", bound=Callable[..., Any])


def now_ns() -> int:
    """Current Unix epoch time in nanoseconds on the tracer's monotonic clock."""
    return _perf_ns() + _EPOCH_OFFSET_NS


def env_enabled(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(ENV_ENABLE, "").strip() == "1"


def resolve_trace_dir(
    run_dir: str | Path | None, trace_dir: str | Path | None = None, env: Mapping[str, str] | None = None
) -> Path:
    """Where traces go: explicit `trace_dir`, else $RL_TRAIN_PHASE_TRACE_DIR, else `<run_dir>/traces`."""
    environ = os.environ if env is None else env
    if trace_dir is not None:
        return Path(trace_dir)
    if environ.get(ENV_DIR):
        return Path(environ[ENV_DIR])
    if run_dir is None:
        raise ValueError(
            "phase tracing is enabled but no directory is known: pass the run directory, "
            f"trace_dir=..., or set {ENV_DIR}"
        )
    return Path(run_dir) / TRACE_SUBDIR


@dataclass(frozen=True)
class TraceSettings:
    """Picklable tracing settings to hand to Ray actors and subprocesses (a tracer itself is not)."""

    enabled: bool
    directory: str | None


class _LineTemplates(dict[str, str]):
    """Line templates of one record kind, keyed by phase name."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set(self, **attrs: Any) -> None:
        return None


_NULL_SPAN = _NullSpan()


class _Span:
    __slots__ = ("_tracer", "_name", "_step", "_attrs", "_start")

    def __init__(self, tracer: PhaseTracer, name: str, step: int | None, attrs: dict[str, Any]) -> None:
        self._tracer = tracer
        self._name = name
        self._step = step
        self._attrs = attrs

    def __enter__(self) -> _Span:
        self._start = _perf_ns()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        end = _perf_ns()
        attrs = self._attrs
        if exc_type is not None:
            attrs = {**attrs, "error": exc_type.__name__}
        label = getattr(_thread_state, "label", _UNSET)
        if label is _UNSET:
            label = _thread_label()
        tracer = self._tracer
        queue = tracer._queue
        queue.append((tracer._span_lines, self._name, self._step, self._start, end, attrs, label))
        if len(queue) >= tracer._flush_at:
            tracer._overflow()

    def set(self, **attrs: Any) -> None:
        """Add attributes known only inside the span (e.g. token counts)."""
        self._attrs.update(attrs)


class PhaseTracer:
    """Writes one process's phase records. Create with `PhaseTracer.open(...)` or `PhaseTracer.disabled()`."""

    def __init__(
        self,
        path: Path | None,
        *,
        role: str,
        rank: int,
        flush_interval_s: float = 0.5,
        flush_at: int = 4096,
        max_pending: int = 1_000_000,
    ) -> None:
        self.role = role
        self.rank = rank
        self.path = path
        self.enabled = path is not None
        self.dropped = 0
        self.write_errors = 0
        self._flush_interval_s = flush_interval_s
        self._flush_at = flush_at
        self._max_pending = max_pending
        self._queue: deque[tuple[Any, ...]] = deque()
        # line templates per record kind, keyed by phase name; a queued record carries its kind's table
        self._span_lines = _LineTemplates(_KIND_SPAN)
        self._instant_lines = _LineTemplates(_KIND_INSTANT)
        self._counter_lines = _LineTemplates(_KIND_COUNTER)
        self._closed = not self.enabled
        self._dormant = False  # a forked child's tracer until its first record
        self._fd = -1
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._open_file()
            _LIVE.add(self)

    # ---- construction -------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        run_dir: str | Path | None,
        *,
        role: str,
        rank: int,
        enabled: bool = False,
        trace_dir: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        **options: Any,
    ) -> PhaseTracer:
        """A tracer for this process. On when `enabled` (the `phase_trace_enabled` config field) is true or
        RL_TRAIN_PHASE_TRACE=1; otherwise a no-op tracer that creates no file."""
        if not isinstance(role, str) or not role:
            raise ValueError(f"phase trace role must be a non-empty string, got {role!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"phase trace rank must be a non-negative integer, got {rank!r}")
        if not (enabled or env_enabled(env)):
            return cls(None, role=role, rank=rank)
        directory = resolve_trace_dir(run_dir, trace_dir, env)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            return cls(directory / f"phase_trace_rank{rank}.jsonl", role=role, rank=rank, **options)
        except OSError as exc:
            raise OSError(
                f"cannot write phase traces to {str(directory)!r} ({exc.strerror or exc}); choose a writable "
                f"directory with {ENV_DIR} or turn tracing off (phase_trace_enabled: false)"
            ) from exc

    @classmethod
    def from_settings(cls, settings: TraceSettings, *, role: str, rank: int, **options: Any) -> PhaseTracer:
        """The tracer of a worker given its controller's `settings()` (e.g. inside a Ray actor)."""
        if not settings.enabled or settings.directory is None:
            return cls(None, role=role, rank=rank)
        return cls.open(None, role=role, rank=rank, enabled=True, trace_dir=settings.directory, **options)

    @classmethod
    def disabled(cls, role: str = "controller", rank: int = 0) -> PhaseTracer:
        return cls(None, role=role, rank=rank)

    @property
    def directory(self) -> Path | None:
        return None if self.path is None else self.path.parent

    def settings(self) -> TraceSettings:
        return TraceSettings(self.enabled, None if self.directory is None else str(self.directory))

    def __getstate__(self) -> None:
        raise TypeError("a PhaseTracer cannot be pickled; pass tracer.settings() and use from_settings()")

    # ---- hot path -----------------------------------------------------------------------------------

    def span(self, name: str, step: int | None = None, **attrs: Any) -> _Span | _NullSpan:
        """Context manager timing `name`; extra keyword arguments become `attrs`."""
        if self._closed and not self._revive():
            return _NULL_SPAN
        return _Span(self, name, step, attrs)

    def instant(self, name: str, step: int | None = None, **attrs: Any) -> None:
        if self._closed and not self._revive():
            return
        t = _perf_ns()
        self._push((self._instant_lines, name, step, t, t, attrs, _thread_label()))

    def counter(self, name: str, values: Mapping[str, float], step: int | None = None) -> None:
        """One sample of a counter track, e.g. counter("pool.gpus", {"train": 4, "rollout": 4})."""
        if self._closed and not self._revive():
            return
        t = _perf_ns()
        self._push((self._counter_lines, name, step, t, t, dict(values), _thread_label()))

    def record(self, name: str, start_ns: int, end_ns: int, step: int | None = None, **attrs: Any) -> None:
        """A span measured elsewhere, with Unix epoch nanosecond bounds."""
        if self._closed and not self._revive():
            return
        offset = _EPOCH_OFFSET_NS
        self._push((self._span_lines, name, step, start_ns - offset, end_ns - offset, attrs, _thread_label()))

    def traced(self, name: str, step_arg: str = "step") -> Callable[[F], F]:
        """Decorator: each call of the function is a span; its `step_arg` keyword (if given) is the step."""
        return _traced(lambda: self, name, step_arg)

    def _push(self, item: tuple[Any, ...]) -> None:
        queue = self._queue
        queue.append(item)
        if len(queue) >= self._flush_at:
            self._overflow()

    def _overflow(self) -> None:
        """Enough records wait: wake the writer; past `max_pending` drop the newest (never block)."""
        queue = self._queue
        if len(queue) > self._max_pending:
            queue.pop()
            self.dropped += 1
        self._wake.set()

    # ---- background writing -------------------------------------------------------------------------

    def _open_file(self) -> None:
        assert self.path is not None
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._terminate_partial_line()
        self._pid = os.getpid()
        for table in (self._span_lines, self._instant_lines, self._counter_lines):
            table.clear()  # the pid in the line prefix changes in a forked child
        self._prefix = (
            f',"role":{json.dumps(self.role)},"rank":{self.rank},"pid":{self._pid},'
            f'"host":{json.dumps(socket.gethostname())}'
        )
        self._thread = threading.Thread(target=self._run, name=f"phase-trace-{self.rank}", daemon=True)
        self._thread.start()

    def _terminate_partial_line(self) -> None:
        assert self.path is not None
        size = os.fstat(self._fd).st_size
        if size == 0:
            return
        with open(self.path, "rb") as handle:
            handle.seek(size - 1)
            if handle.read(1) != b"\n":
                os.write(self._fd, b"\n")

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self._flush_interval_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Write every record pushed so far (called by the background thread; safe from any thread)."""
        with self._write_lock:
            if self._fd < 0:
                return
            queue = self._queue
            while queue:
                batch = [queue.popleft() for _ in range(min(len(queue), _WRITE_BATCH))]
                self._write(self._encode(batch).encode("utf-8", "replace"))

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
        except OSError as exc:
            self.write_errors += 1  # never raise into training; the records are lost
            if self.write_errors == 1:
                logging.getLogger(__name__).warning(
                    "cannot write phase trace %s (%s); its records are dropped from now on while this lasts, "
                    "training goes on. Free space on that file system to keep tracing (or set phase_trace_enabled: "
                    "false)", self.path, exc.strerror or exc)

    def _template(self, table: _LineTemplates, name: str) -> str:
        static = f'{{"schema":{SCHEMA_VERSION},"name":{json.dumps(str(name))}{self._prefix}'
        template = static.replace("%", "%%") + f',"step":%s,"start_ns":%d,"end_ns":%d,"kind":"{table.kind}"%s}}\n'
        table[name] = template
        return template

    def _encode(self, batch: list[tuple[Any, ...]]) -> str:
        """JSON lines of a batch; one loop without per-record calls, since this competes for the GIL."""
        offset = _EPOCH_OFFSET_NS
        lines: list[str] = []
        for table, name, step, start, end, attrs, thread in batch:
            template = table.get(name) or self._template(table, name)
            if step is None:
                step = "null"
            elif type(step) is not int:
                step = _int_or_null(step)
            tail = ""
            if thread is not None:
                tail = ',"thread":' + _quote(thread)
            if attrs:
                tail += ',"attrs":' + _encode_attrs(attrs)
            lines.append(template % (step, start + offset, end + offset, tail))
        return "".join(lines)

    def close(self) -> None:
        """Flush everything and stop writing; later spans are ignored. Idempotent."""
        self._dormant = False
        if self._fd < 0:
            self._closed = True
            return
        self._closed = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            thread.join(timeout=5.0)
        self.flush()
        with self._write_lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        _LIVE.discard(self)

    def __enter__(self) -> PhaseTracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _after_fork_in_child(self) -> None:
        """Forked child: drop the parent's pending records (the parent writes them) and go dormant; the
        first record of the child opens a file of its own (so a crash of either process cannot cut the
        other's lines, and children that only exec leave no empty files)."""
        self._queue = deque()
        self._write_lock = threading.Lock()
        self._wake = threading.Event()
        self._thread = None
        self._fd = -1
        if self._closed or self.path is None:
            return
        self._closed = True
        self._dormant = True

    def _revive(self) -> bool:
        """Open the forked child's own file on its first record; False when the tracer is really closed."""
        if not self._dormant:
            return False
        with self._write_lock:
            if self._dormant and self.path is not None:
                base = self.path.name.split("-pid")[0].removesuffix(".jsonl")
                self.path = self.path.with_name(f"{base}-pid{os.getpid()}.jsonl")
                self._dormant = False
                self._closed = False  # before the writer thread starts: it runs while not closed
                self._open_file()
        return not self._closed


_ATTRS_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str, allow_nan=False)
_quote = encode_basestring_ascii


_key_prefixes: dict[str, str] = {}  # '"key":' per attribute name seen


def _encode_attrs(attrs: Mapping[str, Any]) -> str:
    """JSON of attrs; flat str/int/float/bool/None values are encoded inline (several times faster than
    a JSONEncoder call), anything else goes through the encoder with str() as the fallback."""
    parts = []
    for key, value in attrs.items():
        prefix = _key_prefixes.get(key)
        if prefix is None:
            if type(key) is not str:
                return _encode_attrs_general(attrs)
            if len(_key_prefixes) > 10_000:
                _key_prefixes.clear()
            prefix = _key_prefixes[key] = _quote(key) + ":"
        kind = type(value)
        if kind is int:
            parts.append(prefix + int.__repr__(value))
        elif kind is str:
            parts.append(prefix + _quote(value))
        elif kind is float and math.isfinite(value):
            parts.append(prefix + float.__repr__(value))
        elif value is None:
            parts.append(prefix + "null")
        elif kind is bool:
            parts.append(prefix + ("true" if value else "false"))
        else:
            return _encode_attrs_general(attrs)
    return "{" + ",".join(parts) + "}"


def _encode_attrs_general(attrs: Mapping[str, Any]) -> str:
    try:
        return _ATTRS_ENCODER.encode(_strict_json(attrs))
    except (TypeError, ValueError):
        return _ATTRS_ENCODER.encode({str(k): repr(v) for k, v in attrs.items()})


def _strict_json(value: Any) -> Any:
    """String keys, and non-finite floats as text ("nan", "inf"): strict JSON readers reject NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, Mapping):
        return {str(k): _strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict_json(v) for v in value]
    return value


def _int_or_null(step: Any) -> int | str:
    try:
        return int(step)
    except (TypeError, ValueError):
        return "null"


def _thread_label() -> str | None:
    """None on the main thread, else the thread's name (cached per thread: it becomes a track name)."""
    label = getattr(_thread_state, "label", _UNSET)
    if label is _UNSET:
        current = threading.current_thread()
        label = None if current is threading.main_thread() else current.name
        _thread_state.label = label
    return label  # type: ignore[return-value]


def _traced(get: Callable[[], PhaseTracer], name: str, step_arg: str) -> Callable[[F], F]:
    def decorate(func: F) -> F:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with get().span(name, kwargs.get(step_arg)):
                    return await func(*args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with get().span(name, kwargs.get(step_arg)):
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


# ---- process-wide tracer ----------------------------------------------------------------------------

_LIVE: weakref.WeakSet[PhaseTracer] = weakref.WeakSet()
_current = PhaseTracer.disabled()


def get_tracer() -> PhaseTracer:
    """The process-wide tracer (a disabled one until `set_tracer`)."""
    return _current


def set_tracer(tracer: PhaseTracer) -> PhaseTracer:
    """Install the process-wide tracer; returns the previous one."""
    global _current
    previous, _current = _current, tracer
    return previous


def span(name: str, step: int | None = None, **attrs: Any) -> _Span | _NullSpan:
    """`get_tracer().span(...)`."""
    return _current.span(name, step, **attrs)


def traced(name: str, step_arg: str = "step") -> Callable[[F], F]:
    """Decorator spanning each call on whatever tracer is installed at call time."""
    return _traced(get_tracer, name, step_arg)


def close_all(tracers: Iterable[PhaseTracer] | None = None) -> None:
    for tracer in list(_LIVE if tracers is None else tracers):
        tracer.close()


def _after_fork_in_child() -> None:
    _thread_state.__dict__.pop("label", None)  # the forking thread is the child's main thread
    for tracer in list(_LIVE):
        tracer._after_fork_in_child()


class _ForkMarker:
    """Anchor for multiprocessing's after-fork registry (it keeps weak references)."""


_FORK_MARKER = _ForkMarker()


def _register_multiprocessing_exit(_: object) -> None:
    # multiprocessing's fork children leave through os._exit, which skips atexit; its own exit hook runs.
    multiprocessing.util.Finalize(None, close_all, exitpriority=100)


atexit.register(close_all)
os.register_at_fork(after_in_child=_after_fork_in_child)
multiprocessing.util.register_after_fork(_FORK_MARKER, _register_multiprocessing_exit)
