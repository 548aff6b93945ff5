"""Rules of the weight reload protocol: ACK validation, serial/parallel schedules, the refresh report."""

from __future__ import annotations

from dataclasses import replace

import pytest

from libra.rollout.lifecycle import next_instance_id, worker_report
from libra.rollout.reload import (
    AckExpectation,
    ReloadAck,
    WeightSyncError,
    build_report,
    is_sync_step,
    parallel_waves,
    serial_waves,
    validate_acks,
)

SUM = "sha256t1:" + "ab" * 32
OTHER = "sha256t1:" + "cd" * 32


def expectation() -> AckExpectation:
    return AckExpectation(
        version=3, checksum=SUM, method="inplace", strategy="parallel", instance_ids=["r0", "r1"]
    )


def ack(instance_id: str, **changes: object) -> ReloadAck:
    base = ReloadAck(
        instance_id=instance_id,
        host="127.0.0.1",
        method="inplace",
        strategy="parallel",
        weight_version=3,
        checksum=SUM,
        lock_wait_s=0.0,
        process_stop_s=0.0,
        model_load_s=0.02,
        total_s=0.05,
        worker_checksums=(SUM,),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


CASES: dict[str, tuple[list[ReloadAck], dict[str, str]]] = {
    "complete batch": ([ack("r0"), ack("r1")], {}),
    "missing ACK": ([ack("r0")], {"r1": "no ACK"}),
    "old version": ([ack("r0"), ack("r1", weight_version=2)], {"r1": "weight version 2, expected 3"}),
    "wrong checksum": ([ack("r0", checksum=OTHER), ack("r1")], {"r0": f"checksum {OTHER}"}),
    "reload error": ([ack("r0"), ack("r1", error="ServerStartError: boom")], {"r1": "reload failed: Server"}),
    "TP workers disagree": (
        [ack("r0", worker_checksums=(SUM, OTHER)), ack("r1")],
        {"r0": "workers disagree"},
    ),
    "parameter not loaded": (
        [ack("r0", params_not_loaded=("lm_head.weight",)), ack("r1")],
        {"r0": "not loaded"},
    ),
    "parameter differs": ([ack("r0"), ack("r1", param_value_mismatches=("norm",))], {"r1": "differ"}),
    "wrong method": ([ack("r0", method="restart"), ack("r1")], {"r0": "method=restart"}),
    "negative time": ([ack("r0", total_s=-1.0), ack("r1")], {"r0": "invalid timings"}),
    "stranger": ([ack("r0"), ack("r1"), ack("r9")], {"r9": "not part of"}),
    "duplicate": ([ack("r0"), ack("r1"), ack("r1")], {"r1": "more than one ACK"}),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_validate_acks(case: str) -> None:
    acks, expected = CASES[case]
    failures = validate_acks(expectation(), acks)
    assert set(failures) == set(expected)
    for iid, fragment in expected.items():
        assert fragment in failures[iid]


def test_weight_sync_error_names_each_instance() -> None:
    error = WeightSyncError(3, {"r1": "no ACK", "r0": "checksum differs"})
    text = str(error)
    assert "weight version 3" in text and "r0: checksum differs" in text and "r1: no ACK" in text


@pytest.mark.parametrize(
    ("instances", "serial", "parallel"),
    [
        ([], [], []),
        ([("a", "n1")], [["a"]], [["a"]]),
        ([("a", "n1"), ("b", "n2"), ("c", "n1")], [["a"], ["c"], ["b"]], [["a", "b", "c"]]),
    ],
    ids=["empty", "one", "two-nodes"],
)
def test_waves(instances: list[tuple[str, str]], serial: list[list[str]], parallel: list[list[str]]) -> None:
    assert serial_waves(instances) == serial
    assert parallel_waves(instances) == parallel


def test_report_names_the_slowest_instance_and_phases() -> None:
    acks = [ack("r0", total_s=0.3, model_load_s=0.2), ack("r1", total_s=0.9, model_load_s=0.8)]
    report = build_report(expectation(), acks, total_s=1.0, waves=[["r0", "r1"]])
    assert (report.slowest_instance, report.slowest_total_s) == ("r1", 0.9)
    assert (report.acks_expected, report.acks_validated) == (2, 2)
    assert report.phase_summary()["model_load_s"] == pytest.approx({"max": 0.8, "mean": 0.5})
    assert report.to_dict()["acks"][1]["instance_id"] == "r1"


@pytest.mark.parametrize(
    ("step", "interval", "sync"),
    [(1, 1, True), (2, 1, True), (1, 2, False), (2, 2, True), (3, 2, False), (0, 1, False)],
)
def test_sync_interval(step: int, interval: int, sync: bool) -> None:
    assert is_sync_step(step, interval) is sync


def test_sync_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="sync_interval=0"):
        is_sync_step(1, 0)


def test_worker_report_merges_tp_workers() -> None:
    results = [
        {
            "weight_version": 4,
            "checksum": SUM,
            "load_s": 0.1,
            "params_not_loaded": [],
            "params_value_checked": 7,
        },
        {
            "weight_version": 4,
            "checksum": OTHER,
            "load_s": 0.3,
            "params_not_loaded": ["x"],
            "params_value_checked": 2,
        },
    ]
    report = worker_report(results, "r0")
    assert report["worker_checksums"] == (SUM, OTHER) and report["workers"] == 2
    assert (
        report["load_s"] == 0.3
        and report["params_not_loaded"] == ("x",)
        and report["params_value_checked"] == 2
    )


@pytest.mark.parametrize(
    ("existing", "new"),
    [([], "rollout-0"), (["rollout-0", "rollout-1"], "rollout-2"), (["rollout-3"], "rollout-4")],
)
def test_next_instance_id(existing: list[str], new: str) -> None:
    assert next_instance_id(existing) == new
