"""Each training rank's phase tracer: rank r writes phase_trace_rank{1000 + r}.jsonl when the spec's trace
settings are on, nothing otherwise."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from libra.config.mapping import cpu_config, training_pool_spec
from libra.observability.phase_trace import TraceSettings
from libra.training.spec import TrainingPoolSpec
from libra.training.worker import open_rank_tracer


def spec_with(trace: TraceSettings | None) -> TrainingPoolSpec:
    return training_pool_spec(cpu_config("/m"), num_gpus=1, trace=trace)


@pytest.mark.parametrize(("rank", "file"), [(0, "phase_trace_rank1000.jsonl"), (7, "phase_trace_rank1007.jsonl")])
def test_rank_writes_its_own_file(tmp_path: Path, rank: int, file: str) -> None:
    tracer = open_rank_tracer(spec_with(TraceSettings(True, str(tmp_path))), rank)
    try:
        assert (tracer.role, tracer.rank, tracer.enabled) == ("train", 1000 + rank, True)
        with tracer.span("train.step", 3):
            pass
    finally:
        tracer.close()
    assert [p.name for p in tmp_path.iterdir()] == [file]
    assert '"name":"train.step"' in (tmp_path / file).read_text()


@pytest.mark.parametrize(
    "trace", [None, TraceSettings(False, None), TraceSettings(False, "/nonexistent")], ids=["none", "off", "off-dir"]
)
def test_tracing_is_off_by_default(trace: TraceSettings | None) -> None:
    assert spec_with(None).trace is None
    assert not open_rank_tracer(spec_with(trace), 0).enabled


def test_rank_outside_the_trace_block_is_not_traced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        tracer = open_rank_tracer(spec_with(TraceSettings(True, str(tmp_path))), 1000)
    assert not tracer.enabled and not list(tmp_path.iterdir())
    assert "training rank 1000 writes no phase trace" in caplog.text
