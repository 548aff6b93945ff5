"""Fuzzed phase-trace lines: the converter skips what is not a valid record, converts the rest, and always
writes a Chrome trace that parses as JSON; it never raises on file content."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from libra.observability.trace_convert import convert

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.floats(allow_nan=False), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=5,
)
ints = st.one_of(st.integers(-(2**70), 2**70), st.integers(0, 10**6))
records = st.fixed_dictionaries(
    {"schema": st.one_of(st.just(1), json_values), "name": st.one_of(
        st.sampled_from(["train.step", "weight_sync.publish", "weight_sync.reload", "weight_sync.ack", "x"]),
        st.text(max_size=8)),
     "role": st.one_of(st.sampled_from(["controller", "train", "rollout"]), st.text(max_size=5)),
     "rank": st.one_of(ints, json_values), "step": st.one_of(st.none(), ints, json_values),
     "start_ns": st.one_of(ints, json_values), "end_ns": st.one_of(ints, json_values)},
    optional={"kind": st.one_of(st.sampled_from(["span", "instant", "counter"]), json_values),
              "attrs": st.one_of(st.dictionaries(st.sampled_from(["flow_id", "v", "pid", "tid", "host"]), json_values,
                                                 max_size=3), json_values),
              "pid": json_values, "tid": json_values, "host": json_values},
)
lines = st.lists(st.one_of(records.map(lambda r: json.dumps(r)), st.text(max_size=40)), max_size=12)


def _valid_span(**changes: Any) -> str:
    record = {"schema": 1, "name": "train.step", "role": "train", "rank": 0, "step": 1, "start_ns": 10, "end_ns": 20}
    record.update(changes)
    return json.dumps(record)


@FUZZ
@given(content=lines, cut=st.booleans())
@example(content=[_valid_span(attrs={"flow_id": [1]})], cut=False)
@example(content=[_valid_span(kind="counter", attrs={"v": 1e308, "w": True})], cut=False)
@example(content=[_valid_span(start_ns=-(2**70), end_ns=2**70)], cut=False)
@example(content=[_valid_span(pid="x", thread={"a": 1}, host=[1])], cut=True)
@example(content=[_valid_span(), _valid_span(pid=[])], cut=False)  # regression: an unhashable pid raised TypeError
@example(content=["[" * 100_000], cut=False)
def test_fuzzed_trace_lines_convert_to_valid_json(tmp_path_factory: pytest.TempPathFactory, content: list[str],
                                                  cut: bool) -> None:
    folder = tmp_path_factory.mktemp("trace")
    text = "\n".join(content) + ("" if cut else "\n")
    (folder / "phase_trace_rank0.jsonl").write_text(text, encoding="utf-8", errors="surrogatepass")
    out = folder / "out.json"
    report = convert(folder, out)
    data = json.loads(out.read_text())
    assert isinstance(data["traceEvents"], list)
    assert report.spans <= len(content)
