"""The operator API over real gRPC, in process, on loopback, against a job of fake pools (fake_job.py):
token checks, every call, the dry run against what the reconciler then does, malformed messages, and the
address and token files."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from libra.api.auth import ADDRESS_FILE, TOKEN_FILE, bearer
from libra.api.client import JobNotRunning, OperatorClient
from libra.api.generated import operator_pb2 as pb
from libra.api.server import OperatorApiError, OperatorServer, start_operator_api

from .fake_job import FakeJob, job_config

Outcome = pb.ReconfigureReply.Outcome


@pytest.fixture
def job(tmp_path: Path) -> Iterator[FakeJob]:
    fake = FakeJob(tmp_path)
    yield fake
    fake.close()


@pytest.fixture
def served(job: FakeJob) -> Iterator[tuple[FakeJob, OperatorServer, OperatorClient]]:
    server = start_operator_api(job)
    assert server is not None
    client = OperatorClient.for_run_dir(job.run.root, timeout_s=10)
    yield job, server, client
    client.close()
    server.stop()


def kinds(job: FakeJob) -> list[str]:
    return [json.loads(line)["kind"] for line in job.run.events_jsonl.read_text().splitlines()]


def operator_events(job: FakeJob) -> list[dict]:
    return [e for e in map(json.loads, job.run.events_jsonl.read_text().splitlines()) if e["kind"] == "operator"]


def test_files_written_private_and_removed(job: FakeJob) -> None:
    server = start_operator_api(job)
    assert server is not None
    token = job.run.root / TOKEN_FILE
    assert stat.S_IMODE(os.stat(token).st_mode) == 0o600
    address = json.loads((job.run.root / ADDRESS_FILE).read_text())
    assert address["address"].startswith("127.0.0.1:") and address["tls"] is False
    server.stop()
    assert not token.exists() and not (job.run.root / ADDRESS_FILE).exists()
    with pytest.raises(JobNotRunning):
        OperatorClient.for_run_dir(job.run.root)


def test_non_loopback_without_tls_refuses_to_start(tmp_path: Path) -> None:
    # the config rule refuses this too; the server checks again (a Config built without the loader)
    import dataclasses

    base = job_config(tmp_path / "run")
    cfg = dataclasses.replace(base, operator_api=dataclasses.replace(base.operator_api, bind_address="0.0.0.0"))
    fake = FakeJob(tmp_path, cfg)
    try:
        with pytest.raises(OperatorApiError, match="tls_cert_path"):
            start_operator_api(fake)
        assert not (fake.run.root / ADDRESS_FILE).exists()
    finally:
        fake.close()


@pytest.mark.parametrize("metadata", [None, bearer("wrong"), (("authorization", "token-without-scheme"),)],
                         ids=["missing", "wrong", "no-bearer-scheme"])
def test_bad_token_is_unauthenticated_and_logged(served: tuple, metadata: object) -> None:
    job, _server, client = served
    for call, request in ((client.stub.Status, pb.StatusRequest()),
                          (client.stub.Reconfigure, pb.ReconfigureRequest(set=["rollout_gpus=1"])),
                          (client.stub.Drain, pb.ControlRequest())):
        with pytest.raises(grpc.RpcError) as err:
            call(request, metadata=metadata, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert kinds(job).count("api_unauthenticated") == 3
    assert not job.step_gate.drain_requested and job.store.get().generation == 0
    assert all(e["outcome"] == "unauthenticated" and e["peer"] for e in operator_events(job))


def test_status(served: tuple) -> None:
    _job, _server, client = served
    reply = client.status()
    assert (reply.rollout_gpus, reply.rollout_instances, reply.rollout_tp_size, reply.train_gpus) == (2, 2, 1, 2)
    assert reply.step == 3 and reply.train_layout.startswith("TP1 PP1")
    info = json.loads(reply.status_json)
    assert info["last_reconfiguration"] is None and info["paused"] is False


def test_invalid_request_changes_nothing_and_lists_every_error(served: tuple) -> None:
    job, _server, client = served
    reply = client.reconfigure(["rolout_gpus=1", "rollout_tp_size=3", "batch_size=8"])
    assert reply.outcome == Outcome.INVALID
    fields = sorted(e.field for e in reply.errors)
    assert "rolout_gpus" in fields and "batch_size" in fields and "rollout_tp_size" in fields
    assert all(e.rule and e.fix for e in reply.errors)
    assert job.store.get().generation == 0 and job.rollout.ops == [("create", "rollout-0", "rollout-1")]
    assert operator_events(job)[-1]["outcome"] == "invalid"


def test_dry_run_plans_what_the_reconciler_then_does(served: tuple) -> None:
    job, _server, client = served
    reply = client.reconfigure(["rollout_tp_size=2"], strategy="diff", dry_run=True)
    assert reply.outcome == Outcome.PLANNED, reply.reason
    plan = reply.plan
    assert job.store.get().generation == 0 and len(job.rollout.ops) == 1  # nothing changed
    planned = [(a.kind, a.member) for a in plan.actions]
    assert plan.rollout_before.startswith("2 x TP1") and plan.rollout_after.startswith("1 x TP2")
    assert plan.samples_per_s_before > 0 and plan.samples_per_s_after > 0 and plan.switch_cost_s > 0
    assert plan.serving_gap_s > 0  # diff stops the TP1 instances before the TP2 one serves
    accepted = client.reconfigure(["rollout_tp_size=2"], strategy="diff")
    assert accepted.outcome == Outcome.ACCEPTED, accepted.reason
    job.settle()
    assert job.store.get().reconfiguring == ""
    done = [op for op in job.rollout.ops[1:] if op[0] in ("start", "stop")]
    # the same actions; the executor runs the stops of one tick at once, so they may end in either order
    assert sorted((k, m) for k, m in planned if k in ("StartRolloutInstance", "StopRolloutInstance")) == sorted(
        ("StartRolloutInstance" if op == "start" else "StopRolloutInstance", member) for op, member in done)


def test_reconfigure_applies_and_status_shows_it(served: tuple) -> None:
    job, _server, client = served
    reply = client.reconfigure(["rollout_gpus=1"])
    assert reply.outcome == Outcome.ACCEPTED and reply.generation == 1
    second = client.reconfigure(["rollout_gpus=2"])
    assert second.outcome == Outcome.REFUSED and "another reconfiguration is running" in second.reason
    job.settle()
    status = client.status()
    assert (status.rollout_instances, status.rollout_gpus, status.reconfiguring) == (1, 1, "")
    last = json.loads(status.status_json)["last_reconfiguration"]
    assert last["request"] == ["rollout_gpus=1"] and last["state"] == "done" and last["strategy"] == "diff"
    assert last["timings"]["seconds"] == 0.5


def test_refused_when_the_job_ends(served: tuple) -> None:
    job, _server, client = served
    job.stop.request("SIGTERM")
    reply = client.reconfigure(["rollout_gpus=1"])
    assert reply.outcome == Outcome.REFUSED and "stopping" in reply.reason
    assert not client.pause().ok


def test_pause_resume_drain(served: tuple) -> None:
    job, _server, client = served
    assert client.pause("maintenance").ok and job.step_gate.paused
    assert client.status().state == "pausing"  # no loop reached a step boundary yet
    assert not client.pause().ok  # already paused
    assert client.resume().ok and not job.step_gate.paused
    assert not client.resume().ok
    reply = client.drain()
    assert reply.ok and reply.state == "draining" and job.step_gate.drain_requested
    calls = [(e["call"], e["outcome"]) for e in operator_events(job)]
    assert calls == [("Pause", "ok"), ("Pause", "refused"), ("Resume", "ok"), ("Resume", "refused"),
                     ("Drain", "ok")]
    assert all("peer" in e and e["ts"] for e in operator_events(job))


def test_stream_events_replays_and_follows(served: tuple) -> None:
    job, _server, client = served
    job.events.emit("marker_before")
    stream = client.events(replay=1, follow=True)
    first = next(stream)
    assert first.kind == "marker_before"
    job.events.emit("marker_after", "hello")
    second = next(stream)
    assert second.kind == "marker_after" and json.loads(second.json)["message"] == "hello"
    stream.close()


@pytest.mark.parametrize("payload", [b"\xff\xff\xff", b"\x0a\x05abc", b"\x18\x01" * 100, b""],
                         ids=["garbage", "truncated-string", "repeated-bool", "empty"])
def test_malformed_bytes_never_break_the_server(served: tuple, payload: bytes) -> None:
    job, server, client = served
    raw = client.channel.unary_unary("/libra.api.Operator/Reconfigure", request_serializer=None,
                                     response_deserializer=None)
    token = (job.run.root / TOKEN_FILE).read_text().strip()
    try:
        raw(payload, metadata=bearer(token), timeout=10)
    except grpc.RpcError as err:
        assert err.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    assert client.status().step == 3
    assert job.store.get().generation == 0
