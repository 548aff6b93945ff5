"""Fuzzed dataset rows: loading a JSON-lines dataset gives prompt records or a `TaskError` naming the file
and line, whatever the lines hold; the records' prompts can be built and scored."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from libra.data import TaskError, TaskSpec, build_task, load_records
from libra.data.preflight import preflight_encode

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=5,
)
rows = st.one_of(
    st.fixed_dictionaries({"prompt": json_values, "answer": json_values},
                          optional={"meta": json_values}).map(json.dumps),
    json_values.map(json.dumps),
    st.text(max_size=40),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(rows, min_size=1, max_size=8))
@example(lines=['{"prompt": "a", "answer": NaN}', '{"prompt": "b", "answer": Infinity}'])
@example(lines=['{"prompt": "\\ud800", "answer": 1}'])
@example(lines=["[" * 100_000])  # regression: RecursionError escaped
@example(lines=['{"prompt": "x", "answer": 1e400}'])
def test_fuzzed_rows_load_or_name_the_line(tmp_path_factory: pytest.TempPathFactory, lines: list[str]) -> None:
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    try:
        records = load_records(str(path))
    except TaskError as err:
        assert str(path) in str(err) and err.fix
        return
    assert records and all(isinstance(r.text, str) and r.text and isinstance(r.label, str) for r in records)
    task = build_task(TaskSpec(name="dataset", dataset_path=str(path)), preflight_encode)
    prompt = next(task.train_prompts(0))
    assert 0.0 <= task.reward(prompt, prompt.label_token_ids, prompt.label) <= 1.0
