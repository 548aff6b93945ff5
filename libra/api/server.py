"""The operator API server of one job: gRPC on background threads of the controller process.

`start_operator_api(job)` reads `operator_api` of the job's configuration, refuses a non-loopback address
without TLS (certificate and key), writes a new token (`<run_dir>/api_token`, mode 0600), binds, starts, and
writes the address (`<run_dir>/api_address.json`). `OperatorServer.stop()` ends the calls in flight and
removes both files, so a stopped job is never mistaken for a running one.
"""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from libra.api.auth import remove_files, target, write_address, write_token
from libra.api.generated import operator_pb2_grpc as pb_grpc
from libra.api.job import JobControl
from libra.api.service import OperatorService
from libra.config.checks_api import is_loopback

MAX_MESSAGE_BYTES = 1 << 20
WORKERS = 8


class OperatorApiError(RuntimeError):
    """The operator API cannot start as configured; the message names the option and the fix."""


@dataclass
class OperatorServer:
    server: grpc.Server
    address: str
    run_root: Path
    info: dict[str, Any]
    service: OperatorService

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving (calls in flight get `grace_s`) and remove the address and token files."""
        try:
            self.server.stop(grace_s).wait(grace_s + 1.0)
        finally:
            remove_files(self.run_root)
            self.service.close()


def start_operator_api(job: JobControl) -> OperatorServer | None:
    """Serve the operator API of `job` as `operator_api` configures it (None when disabled)."""
    api = job.cfg.operator_api
    if not api.enabled:
        return None
    tls = bool(api.tls_cert_path and api.tls_key_path)
    if not is_loopback(api.bind_address) and not tls:
        raise OperatorApiError(
            f"operator_api.bind_address {api.bind_address} is not loopback and operator_api.tls_cert_path / "
            "operator_api.tls_key_path are not both set: the API is served off loopback only over TLS; set both, "
            "or bind_address: 127.0.0.1")
    run_root = job.run.root
    token = write_token(run_root)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="libra-api"),
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", 16 * MAX_MESSAGE_BYTES),
                 ("grpc.so_reuseport", 0)],
        maximum_concurrent_rpcs=4 * WORKERS,
    )
    service = OperatorService(job, token)
    pb_grpc.add_OperatorServicer_to_server(service, server)
    where = target(api.bind_address, api.port)
    try:
        if tls:
            with open(api.tls_key_path, "rb") as key, open(api.tls_cert_path, "rb") as cert:
                credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
            port = server.add_secure_port(where, credentials)
        else:
            port = server.add_insecure_port(where)
    except RuntimeError as exc:
        remove_files(run_root)
        service.close()
        raise OperatorApiError(f"the operator API cannot listen on {where}: {exc}; choose another "
                               "operator_api.port (0 = any free port)") from exc
    server.start()
    info = write_address(run_root, api.bind_address, port, api.tls_cert_path if tls else "")
    job.events.emit("operator_api", f"operator API on {target(api.bind_address, port)}"
                    f"{' (TLS)' if tls else ''}", address=info["address"], tls=tls)
    return OperatorServer(server, info["address"], run_root, info, service)
