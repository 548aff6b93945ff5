"""The phase-trace writer: enabling, record contents, decorators, threads, forks, crashes, overhead."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from libra.observability import phase_trace as pt
from libra.observability.trace_schema import validation_error


def read_lines(path: Path | None) -> list[dict[str, Any]]:
    assert path is not None
    return [json.loads(line) for line in path.read_text().splitlines()]


def path_of(tracer: pt.PhaseTracer) -> Path:
    assert tracer.path is not None
    return tracer.path


def open_tracer(tmp_path: Path, **kw: Any) -> pt.PhaseTracer:
    kw.setdefault("role", "train")
    kw.setdefault("rank", 1000)
    return pt.PhaseTracer.open(tmp_path, enabled=True, env={}, **kw)


@pytest.mark.parametrize(
    ("enabled", "env", "expect_dir"),
    [
        pytest.param(False, {}, None, id="off"),
        pytest.param(False, {"RL_TRAIN_PHASE_TRACE": "0"}, None, id="env-zero-is-off"),
        pytest.param(True, {}, "run/traces", id="config-flag"),
        pytest.param(False, {"RL_TRAIN_PHASE_TRACE": "1"}, "run/traces", id="env-flag"),
        pytest.param(True, {"RL_TRAIN_PHASE_TRACE_DIR": "{tmp}/elsewhere"}, "elsewhere", id="env-dir"),
    ],
)
def test_enabling_and_directory(tmp_path: Path, enabled: bool, env: dict[str, str], expect_dir: str | None
                                ) -> None:
    env = {k: v.replace("{tmp}", str(tmp_path)) for k, v in env.items()}
    tracer = pt.PhaseTracer.open(tmp_path / "run", role="controller", rank=0, enabled=enabled, env=env)
    with tracer.span("controller.tick", step=1):
        pass
    tracer.close()
    if expect_dir is None:
        assert not tracer.enabled and tracer.path is None and not (tmp_path / "run").exists()
    else:
        assert tracer.path == tmp_path / expect_dir / "phase_trace_rank0.jsonl"
        assert [r["name"] for r in read_lines(tracer.path)] == ["controller.tick"]


def test_explicit_trace_dir_and_missing_directory(tmp_path: Path) -> None:
    tracer = pt.PhaseTracer.open(None, role="rollout", rank=2001, enabled=True, trace_dir=tmp_path / "t", env={})
    assert tracer.path == tmp_path / "t" / "phase_trace_rank2001.jsonl"
    tracer.close()
    with pytest.raises(ValueError, match="RL_TRAIN_PHASE_TRACE_DIR"):
        pt.PhaseTracer.open(None, role="train", rank=1000, enabled=True, env={})


def test_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match="RL_TRAIN_PHASE_TRACE_DIR"):
        pt.PhaseTracer.open(None, role="train", rank=1000, enabled=True, trace_dir=tmp_path / "file" / "t", env={})


@pytest.mark.parametrize(("role", "rank"), [("", 0), ("train", -1), ("train", "3"), ("train", True)])
def test_open_rejects_bad_identity(tmp_path: Path, role: Any, rank: Any) -> None:
    with pytest.raises(ValueError, match="role|rank"):
        pt.PhaseTracer.open(tmp_path, role=role, rank=rank, enabled=True, env={})


def test_records_follow_schema(tmp_path: Path) -> None:
    tracer = open_tracer(tmp_path)
    before = time.time_ns()
    with tracer.span("train.step", step=4, layers=2):
        with tracer.span("train.forward_backward", step=4) as inner:
            inner.set(tokens=512, note="ünï")
        tracer.instant("checkpoint.save", step=4, path="/x")
    tracer.counter("pool.gpus", {"train": 4, "rollout": 4})
    tracer.record("eval", before - 1_000, before + 2_001, step=None, score=0.5)
    after = time.time_ns()
    tracer.close()
    records = read_lines(tracer.path)
    assert all(validation_error(r) is None for r in records)
    by_name = {r["name"]: r for r in records}
    assert [r["name"] for r in records] == ["train.forward_backward", "checkpoint.save", "train.step",
                                            "pool.gpus", "eval"]
    outer, inner_rec = by_name["train.step"], by_name["train.forward_backward"]
    assert outer["start_ns"] <= inner_rec["start_ns"] <= inner_rec["end_ns"] <= outer["end_ns"]
    assert before - 1_000_000 <= outer["start_ns"] and outer["end_ns"] <= after + 1_000_000
    assert inner_rec["attrs"] == {"tokens": 512, "note": "ünï"}
    assert outer["attrs"] == {"layers": 2} and outer["kind"] == "span" and outer["step"] == 4
    assert by_name["checkpoint.save"]["kind"] == "instant"
    assert by_name["pool.gpus"]["kind"] == "counter"
    assert by_name["pool.gpus"]["attrs"] == {"train": 4, "rollout": 4}
    assert (by_name["eval"]["start_ns"], by_name["eval"]["end_ns"]) == (before - 1_000, before + 2_001)
    assert all(r["role"] == "train" and r["rank"] == 1000 and r["pid"] == os.getpid() for r in records)
    assert all("thread" not in r for r in records)


@pytest.mark.parametrize(
    ("attrs", "expected"),
    [
        pytest.param({"a": 1, "b": "x", "c": None, "d": True, "e": 1.5}, None, id="flat"),
        pytest.param({"nested": {"k": [1, 2]}}, None, id="nested"),
        pytest.param({"nan": float("nan"), "deep": [float("inf")]}, {"nan": "nan", "deep": ["inf"]},
                     id="non-finite-as-text"),
        pytest.param({"obj": Path("/p"), "m": {3: "x"}}, {"obj": "/p", "m": {"3": "x"}}, id="object-as-str"),
    ],
)
def test_attr_values_always_serialize(tmp_path: Path, attrs: dict[str, Any], expected: Any) -> None:
    tracer = open_tracer(tmp_path)
    with tracer.span("eval", **attrs):
        pass
    tracer.close()
    (record,) = read_lines(tracer.path)
    assert record["attrs"] == (attrs if expected is None else expected)


def test_exception_is_recorded_and_propagates(tmp_path: Path) -> None:
    tracer = open_tracer(tmp_path)
    with pytest.raises(RuntimeError), tracer.span("train.optimizer", step=2):
        raise RuntimeError("boom")
    tracer.close()
    (record,) = read_lines(tracer.path)
    assert record["attrs"] == {"error": "RuntimeError"}


def test_traced_decorators(tmp_path: Path) -> None:
    tracer = open_tracer(tmp_path)

    @tracer.traced("rollout.generate")
    def generate(prompts: int, *, step: int | None = None) -> int:
        return prompts * 2

    @pt.traced("rollout.reward")
    async def reward(step: int) -> str:
        await asyncio.sleep(0)
        return "ok"

    previous = pt.set_tracer(tracer)
    try:
        assert pt.get_tracer() is tracer
        assert generate(3, step=7) == 6 and generate(1) == 2
        assert asyncio.run(reward(step=9)) == "ok"
        with pt.span("eval", step=1):
            pass
    finally:
        pt.set_tracer(previous)
    assert asyncio.run(reward(step=10)) == "ok"  # the disabled default tracer records nothing
    tracer.close()
    assert [(r["name"], r["step"]) for r in read_lines(tracer.path)] == [
        ("rollout.generate", 7), ("rollout.generate", None), ("rollout.reward", 9), ("eval", 1)]


def test_disabled_tracer_is_a_no_op(tmp_path: Path) -> None:
    tracer = pt.PhaseTracer.disabled()
    with tracer.span("train.step", step=1) as s:
        s.set(ignored=True)
    tracer.instant("eval")
    tracer.counter("pool.gpus", {"train": 1})
    tracer.close()
    assert tracer.settings() == pt.TraceSettings(False, None)
    assert list(tmp_path.iterdir()) == []


def test_settings_cross_process_boundary(tmp_path: Path) -> None:
    controller = open_tracer(tmp_path, role="controller", rank=0)
    settings = pickle.loads(pickle.dumps(controller.settings()))
    with pytest.raises(TypeError, match="settings"):
        pickle.dumps(controller)
    worker = pt.PhaseTracer.from_settings(settings, role="rollout", rank=2003)
    assert worker.path == tmp_path / "traces" / "phase_trace_rank2003.jsonl"
    worker.close()
    controller.close()
    assert not pt.PhaseTracer.from_settings(pt.TraceSettings(False, None), role="train", rank=1).enabled


def test_background_flush_without_close(tmp_path: Path) -> None:
    tracer = open_tracer(tmp_path, flush_interval_s=0.02)
    with tracer.span("controller.tick"):
        pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not path_of(tracer).read_text():
        time.sleep(0.01)
    assert len(read_lines(tracer.path)) == 1
    tracer.close()


def test_threads_write_concurrently(tmp_path: Path) -> None:
    tracer = open_tracer(tmp_path, flush_at=64, flush_interval_s=0.005)
    n_threads, per_thread = 8, 1500

    def work(t: int) -> None:
        for i in range(per_thread):
            with tracer.span("rollout.generate", step=i, worker=t, seq=i):
                pass

    threads = [threading.Thread(target=work, args=(t,), name=f"w{t}") for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    tracer.close()
    records = read_lines(tracer.path)
    seen = sorted((r["attrs"]["worker"], r["attrs"]["seq"]) for r in records)
    assert seen == [(t, i) for t in range(n_threads) for i in range(per_thread)]
    assert {r["thread"] for r in records} <= {f"w{t}" for t in range(n_threads)}
    assert tracer.dropped == 0 and tracer.write_errors == 0


def test_overflow_drops_instead_of_blocking(tmp_path: Path) -> None:
    tracer = open_tracer(tmp_path, flush_at=10, max_pending=20, flush_interval_s=60)
    with tracer._write_lock:  # a stalled writer
        for i in range(100):
            with tracer.span("eval", step=i):
                pass
        assert len(tracer._queue) <= 21
    tracer.close()
    assert tracer.dropped >= 79
    assert len(read_lines(tracer.path)) + tracer.dropped == 100


def test_partial_last_line_is_terminated_on_reopen(tmp_path: Path) -> None:
    path = tmp_path / "traces" / "phase_trace_rank1000.jsonl"
    path.parent.mkdir()
    path.write_text('{"schema":1,"name":"x"}\n{"schema":1,"na')
    tracer = open_tracer(tmp_path)
    with tracer.span("train.step", step=1):
        pass
    tracer.close()
    lines = path.read_text().splitlines()
    assert lines[1] == '{"schema":1,"na' and json.loads(lines[2])["name"] == "train.step"


_CRASH_CHILD = """
import sys
from libra.observability.phase_trace import PhaseTracer
tracer = PhaseTracer.open(None, role="train", rank=1000, enabled=True, trace_dir=sys.argv[1], env={},
                          flush_at=32, flush_interval_s=0.001)
i = 0
while True:
    with tracer.span("train.forward_backward", step=i, seq=i, pad="x" * 300):
        pass
    i += 1
"""


@pytest.mark.parametrize("kill_at_bytes", [200_000, 1_500_000])
def test_killed_writer_loses_at_most_the_last_partial_line(tmp_path: Path, kill_at_bytes: int) -> None:
    path = tmp_path / "phase_trace_rank1000.jsonl"
    child = subprocess.Popen([sys.executable, "-c", _CRASH_CHILD, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not path.exists() or path.stat().st_size < kill_at_bytes):
            time.sleep(0.002)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # tail is b"" unless the kill cut a line
    records = [json.loads(line) for line in complete]
    assert [r["attrs"]["seq"] for r in records] == list(range(len(records)))
    assert len(records) > 100
    if tail:
        with pytest.raises(ValueError):
            json.loads(tail)
    # the next process on this rank continues the file; only the cut line is lost
    tracer = pt.PhaseTracer.open(None, role="train", rank=1000, enabled=True, trace_dir=tmp_path, env={})
    with tracer.span("train.step", step=0):
        pass
    tracer.close()
    after = path.read_bytes().split(b"\n")
    assert json.loads(after[-2])["name"] == "train.step"
    assert len(after) - 1 == len(records) + (1 if tail else 0) + 1


def _mp_child(trace_dir: str) -> None:
    tracer = pt.get_tracer()
    for i in range(5):
        with tracer.span("rollout.generate", step=i):
            pass
    # no close(): multiprocessing's exit hook must flush


def test_forked_children_write_their_own_file(tmp_path: Path) -> None:
    tracer = open_tracer(tmp_path, role="rollout", rank=2000, flush_at=10_000, flush_interval_s=60)
    previous = pt.set_tracer(tracer)
    try:
        with tracer.span("rollout.reward", step=0):  # pending in the parent at fork time
            pass
        ctx = multiprocessing.get_context("fork")
        proc = ctx.Process(target=_mp_child, args=(str(tmp_path),))
        proc.start()
        proc.join(30)
        assert proc.exitcode == 0
        pid = os.fork()
        if pid == 0:  # a bare fork: atexit does not run after os._exit, so close explicitly
            with pt.get_tracer().span("eval", step=1):
                pass
            pt.get_tracer().close()
            os._exit(0)
        os.waitpid(pid, 0)
        silent = os.fork()
        if silent == 0:  # a child that records nothing (e.g. one that execs) leaves no file behind
            os._exit(0)
        os.waitpid(silent, 0)
    finally:
        pt.set_tracer(previous)
        tracer.close()
    parent = read_lines(tracer.path)
    assert [r["name"] for r in parent] == ["rollout.reward"] and parent[0]["pid"] == os.getpid()
    mp_file = path_of(tracer).with_name(f"phase_trace_rank2000-pid{proc.pid}.jsonl")
    mp_records = read_lines(mp_file)
    assert [r["step"] for r in mp_records] == [0, 1, 2, 3, 4]
    assert {r["pid"] for r in mp_records} == {proc.pid} and {r["rank"] for r in mp_records} == {2000}
    fork_records = read_lines(path_of(tracer).with_name(f"phase_trace_rank2000-pid{pid}.jsonl"))
    assert [(r["name"], r["pid"]) for r in fork_records] == [("eval", pid)]
    assert not path_of(tracer).with_name(f"phase_trace_rank2000-pid{silent}.jsonl").exists()


def test_a_span_leaves_encoding_and_writing_to_the_writer_thread(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The hot path only queues: serializing and writing (tens of microseconds per span) happen on the
    writer thread. Structural, not timed: the benchmark `trace_overhead.py` measures the cost per span."""
    callers: dict[str, set[int]] = {"encode": set(), "template": set(), "attrs": set(), "write": set(),
                                    "dumps": set()}

    def on_call(kind: str, original: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            callers[kind].add(threading.get_ident())
            return original(*args, **kwargs)
        return recorded

    monkeypatch.setattr(pt.PhaseTracer, "_encode", on_call("encode", pt.PhaseTracer._encode))
    monkeypatch.setattr(pt.PhaseTracer, "_template", on_call("template", pt.PhaseTracer._template))
    monkeypatch.setattr(pt.PhaseTracer, "_write", on_call("write", pt.PhaseTracer._write))
    monkeypatch.setattr(pt, "_encode_attrs", on_call("attrs", pt._encode_attrs))
    tracer = open_tracer(tmp_path, flush_at=1000, flush_interval_s=0.01)
    monkeypatch.setattr(pt.json, "dumps", on_call("dumps", json.dumps))
    n = 5_000
    for i in range(n):
        with tracer.span("train.forward_backward", step=i, tokens=i, kind="policy"):
            pass
        if i % 1000 == 0:
            time.sleep(0.02)  # lets the writer thread drain while the loop still runs
    during_the_loop = {kind: set(threads) for kind, threads in callers.items()}
    tracer.close()
    caller = threading.get_ident()
    assert all(caller not in threads for threads in during_the_loop.values()), during_the_loop
    assert during_the_loop["encode"] and during_the_loop["write"] and during_the_loop["attrs"], during_the_loop
    assert len(path_of(tracer).read_text().splitlines()) == n
