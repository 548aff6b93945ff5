"""The operator API client the CLI uses: finds a running job from its run directory alone (address and token
files the controller wrote there) and wraps each call."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from libra.api.auth import bearer, read_address, read_token
from libra.api.generated import operator_pb2 as pb
from libra.api.generated import operator_pb2_grpc as pb_grpc
from libra.run_dir import process_alive_here

DEFAULT_TIMEOUT_S = 30.0


class JobNotRunning(RuntimeError):
    """No live operator API for this run directory (the job has stopped, or has not started it yet)."""


class OperatorClient:
    def __init__(self, address: str, token: str, tls_cert_path: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._metadata = bearer(token)
        if tls_cert_path:
            with open(tls_cert_path, "rb") as fh:
                credentials = grpc.ssl_channel_credentials(root_certificates=fh.read())
            self.channel = grpc.secure_channel(address, credentials)
        else:
            self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.OperatorStub(self.channel)

    @classmethod
    def for_run_dir(cls, run_dir: str | os.PathLike[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> OperatorClient:
        """The client of the job running in `run_dir`; JobNotRunning when none is."""
        root = Path(run_dir).expanduser().resolve()
        info = read_address(root)
        if info is None or process_alive_here(info.get("pid"), info.get("host")) is False:
            raise JobNotRunning(f"no running job in {root} (no live operator API: {root / 'api_address.json'} is "
                                "missing or its controller process is gone)")
        return cls(str(info["address"]), read_token(root), str(info.get("tls_cert_path") or ""), timeout_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> OperatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise JobNotRunning(f"the job's operator API at {self.address} does not answer "
                                    f"({err.code().name}: {err.details()})") from err
            raise

    def status(self) -> pb.StatusReply:
        return self._call(self.stub.Status, pb.StatusRequest())

    def plan(self) -> pb.PlanReply:
        return self._call(self.stub.GetPlan, pb.GetPlanRequest())

    def reconfigure(self, overrides: Sequence[str], strategy: str = "", dry_run: bool = False) -> pb.ReconfigureReply:
        return self._call(self.stub.Reconfigure, pb.ReconfigureRequest(set=list(overrides), strategy=strategy,
                                                                        dry_run=dry_run))

    def pause(self, reason: str = "") -> pb.ControlReply:
        return self._call(self.stub.Pause, pb.ControlRequest(reason=reason))

    def resume(self, reason: str = "") -> pb.ControlReply:
        return self._call(self.stub.Resume, pb.ControlRequest(reason=reason))

    def drain(self, reason: str = "") -> pb.ControlReply:
        return self._call(self.stub.Drain, pb.ControlRequest(reason=reason))

    def events(self, replay: int = 20, follow: bool = False) -> Iterator[pb.Event]:
        """The last `replay` events, then (with `follow`) new ones until the job stops or the caller stops."""
        stream = self.stub.StreamEvents(pb.StreamEventsRequest(replay=replay, follow=follow),
                                        metadata=self._metadata, timeout=None if follow else self.timeout_s)
        try:
            yield from stream
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                return  # the job stopped
            raise
        finally:
            stream.cancel()
