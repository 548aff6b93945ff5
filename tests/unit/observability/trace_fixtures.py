"""Test helpers: a synthetic run written independently of Libra's writer: plain json.dumps lines in the minimal schema,
with malformed and cut-off lines mixed in, plus the list of valid records for independent checks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

T0 = 1_700_000_000_123_456_789  # odd nanoseconds on purpose: conversions must stay exact


@dataclass
class SyntheticTrace:
    directory: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: dict[str, int] = field(default_factory=dict)  # file name -> lines that must be skipped
    cut_off_files: set[str] = field(default_factory=set)

    def spans(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("kind", "span") == "span"]


def _rec(name: str, role: str, rank: int, step: Any, start: int, end: int, **extra: Any) -> dict:
    rec: dict[str, Any] = {"schema": 1, "name": name, "role": role, "rank": rank, "step": step,
                           "start_ns": start, "end_ns": end}
    rec.update(extra)
    return rec


def build_run(directory: Path, steps: int = 3, train_ranks: int = 2, rollout_ranks: int = 2,
              slow: float = 1.0) -> SyntheticTrace:
    """Write a small RL run: controller ticks and pool counters, rollout generation and reloads,
    training steps with three sub-phases, weight publishes linked to reloads by flow_id."""
    directory.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[dict[str, Any]]] = {}
    step_len = 10_000_003
    for step in range(steps):
        base = T0 + step * step_len
        files.setdefault("phase_trace_rank0.jsonl", []).extend([
            _rec("controller.tick", "controller", 0, step, base, base + 200_001),
            _rec("pool.gpus", "controller", 0, step, base, base, kind="counter",
                 attrs={"train": train_ranks, "rollout": rollout_ranks}),
            _rec("queue.depth", "controller", 0, step, base + 1, base + 1, kind="counter",
                 attrs={"prompts": 8 - step}),
        ])
        for r in range(rollout_ranks):
            rank = 2000 + r
            gen = int((2_000_000 + 1_111 * r + 7 * step) * slow)
            files.setdefault(f"phase_trace_rank{rank}.jsonl", []).extend([
                _rec("rollout.generate", "rollout", rank, step, base + 300_000, base + 300_000 + gen,
                     attrs={"tokens": 100 + r}),
                _rec("rollout.reward", "rollout", rank, step, base + 300_000 + gen,
                     base + 300_000 + gen + 50_003),
                _rec("weight_sync.reload", "rollout", rank, step, base + 9_000_000 + r,
                     base + 9_400_000 + r, attrs={"flow_id": step}),
            ])
        for r in range(train_ranks):
            rank = 1000 + r
            s = base + 3_000_000
            fb = int((2_500_001 + 13 * r) * slow)
            phases = [("train.recompute_logprobs", 700_003), ("train.forward_backward", fb),
                      ("train.optimizer", 300_007)]
            recs, t = [], s
            for name, dur in phases:
                recs.append(_rec(name, "train", rank, step, t, t + dur))
                t += dur
            recs.append(_rec("train.step", "train", rank, step, s, t + 11))
            if r == 0:
                recs.append(_rec("weight_sync.publish", "train", rank, step, t + 20, base + 8_900_000,
                                 attrs={"flow_id": step}))
            files.setdefault(f"phase_trace_rank{rank}.jsonl", []).extend(recs)
    trace = SyntheticTrace(directory)
    for name, recs in files.items():
        (directory / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
        trace.records.extend(recs)
    return trace


BAD_LINES = [
    b"this is not json\n",
    b'{"schema": 1, "name": "train.optimizer"}\n',  # missing fields
    json.dumps(_rec("train.optimizer", "train", 1000, 1, 10, 5)).encode() + b"\n",  # end before start
    json.dumps(_rec("train.optimizer", "train", 1000, "one", 1, 5)).encode() + b"\n",  # step not int
    json.dumps({**_rec("train.optimizer", "train", 1000, 1, 1, 5), "schema": 2}).encode() + b"\n",
    b"[1, 2, 3]\n",
    b'\xff\xfe{"schema": 1}\n',  # not UTF-8
]


S = 1_000_000_000


def build_reconfiguration(directory: Path) -> SyntheticTrace:
    """Two rollout reconfigurations as the executor's spans record them (times in seconds from T0):
    2 instances created at 0-1 s; blue_green 2 -> 3 requested at 10 s (green rollout-2..4 start 11-30 s, load
    weights 30-31 s, take over serving at 32.1 s, blue drains until 35 s, done at 40 s); restart_all 3 -> 2
    with drain off requested at 50 s (rollout-2..4 stopped 50-52 s, rollout-5/6 start 52-65 s, serve from
    66 s, done at 70 s). A request starts every second until 75 s and lasts 0.8 s; the one at 50 s is requeued, those at 53 and
    54 s fail."""
    directory.mkdir(parents=True, exist_ok=True)

    def t(seconds: float) -> int:
        return T0 + int(seconds * S)

    def span(name: str, a: float, b: float, **attrs: Any) -> dict[str, Any]:
        return _rec(name, "controller", 0, None, t(a), t(b), attrs=attrs)

    controller = [span("reconfigure.start", 0, 1, member_id=m, tp=1) for m in ("rollout-0", "rollout-1")]
    controller += [
        span("reconfigure.swap", 1, 1, serving=["rollout-0", "rollout-1"]),
        span("reconfigure.change", 10, 40, strategy="blue_green", change="grow_2_to_3", drain=True),
        *[span("reconfigure.start", 11, 30, member_id=f"rollout-{i}", tp=1) for i in (2, 3, 4)],
        span("reconfigure.swap", 32, 32.1, serving=["rollout-2", "rollout-3", "rollout-4"]),
        *[span("reconfigure.drain", 32.1, 35, member_id=f"rollout-{i}") for i in (0, 1)],
        span("reconfigure.change", 50, 70, strategy="restart_all", change="shrink_3_to_2", drain=False),
        *[span("reconfigure.stop", 50, 52, member_id=f"rollout-{i}") for i in (2, 3, 4)],
        *[span("reconfigure.start", 52, 65, member_id=f"rollout-{i}", tp=1) for i in (5, 6)],
        span("reconfigure.swap", 66, 66, serving=["rollout-5", "rollout-6"]),
    ]
    for second in range(76):
        attrs: dict[str, Any] = {"groups": 1, "n": 2}
        if second in (53, 54):
            attrs["error"] = "NoServingInstance"
        if second == 50:
            attrs["outcome"] = "requeued"  # aborted by the stop, sent again
        controller.append(span("rollout.generate", second, second + 0.8, **attrs))
    files = {"phase_trace_rank0.jsonl": controller}
    for i in (2, 3, 4):
        files[f"phase_trace_rank{2000 + i}.jsonl"] = [
            _rec("weight_sync.reload", "rollout", 2000 + i, 1, t(30), t(31),
                 attrs={"flow_id": 1, "instance_id": f"rollout-{i}"})]
    trace = SyntheticTrace(directory)
    for name, recs in files.items():
        (directory / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
        trace.records.extend(recs)
    return trace


def build_train_resize(directory: Path) -> SyntheticTrace:
    """A training-pool resize from 2 to 3 ranks as the training edge records it (times in seconds from T0):
    change requested at 10 s, done at 30 s; phases save 12-13, stop 13-14, start 14-26, load 26-28 s (the
    controller's spans, attr pool "train"); ranks 0 and 1 step every 2 s from 0 to 12 s and 28 to 40 s, rank 2
    only from 28 s. One rollout instance serves throughout."""
    directory.mkdir(parents=True, exist_ok=True)

    def t(seconds: float) -> int:
        return T0 + int(seconds * S)

    def span(name: str, a: float, b: float, **attrs: Any) -> dict[str, Any]:
        return _rec(name, "controller", 0, None, t(a), t(b), attrs=attrs)

    controller = [
        span("reconfigure.start", 0, 1, member_id="rollout-0", tp=1),
        span("reconfigure.swap", 1, 1, serving=["rollout-0"]),
        span("reconfigure.change", 10, 30, strategy="train_resize", change="train_2_to_3"),
        *[span(name, a, b, pool="train", phase=f"train_resize.{phase}", step=6, gpus=3) for name, phase, a, b in (
            ("checkpoint.save", "save", 12, 13), ("reconfigure.stop", "stop", 13, 14),
            ("reconfigure.start", "start", 14, 26), ("checkpoint.load", "load", 26, 28))],
    ]
    files = {"phase_trace_rank0.jsonl": controller}
    for rank, starts in ((0, [*range(0, 12, 2), *range(28, 40, 2)]), (1, [*range(0, 12, 2), *range(28, 40, 2)]),
                         (2, list(range(28, 40, 2)))):
        files[f"phase_trace_rank{1000 + rank}.jsonl"] = [
            _rec("train.step", "train", 1000 + rank, i, t(a), t(a + 1.5)) for i, a in enumerate(starts)]
    trace = SyntheticTrace(directory)
    for name, recs in files.items():
        (directory / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
        trace.records.extend(recs)
    return trace
