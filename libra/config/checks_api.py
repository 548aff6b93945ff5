"""Cross-field checks of the network services a running job offers: the operator API (address, TLS) and the
Prometheus exporter's address."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator

from libra.config.context import Finding, RuleContext

API = "operator_api"


def is_loopback(address: str) -> bool:
    """True for a loopback IP address (127.0.0.0/8, ::1) or `localhost`."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _address_problem(address: str) -> str:
    if address == "localhost":
        return ""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return "is not an IP address"
    return ""


def api_address(c: RuleContext) -> Iterator[Finding]:
    problem = _address_problem(c.cfg.operator_api.bind_address)
    if problem:
        yield Finding(f"{API}.bind_address", problem, "write an IPv4 or IPv6 address, e.g. 127.0.0.1 (loopback) or "
                      "0.0.0.0 (every interface, with TLS)")


def prometheus_address(c: RuleContext) -> Iterator[Finding]:
    problem = _address_problem(c.cfg.tracking.prometheus_bind_address)
    if problem:
        yield Finding("tracking.prometheus_bind_address", problem,
                      "write an IPv4 or IPv6 address, e.g. 127.0.0.1 or 0.0.0.0")


def api_tls(c: RuleContext) -> Iterator[Finding]:
    api = c.cfg.operator_api
    if not api.enabled or _address_problem(api.bind_address):
        return
    missing = [name for name in ("tls_cert_path", "tls_key_path") if not getattr(api, name)]
    if len(missing) == 2 and not is_loopback(api.bind_address):
        yield Finding(f"{API}.bind_address", "is not loopback, and the operator API is served off loopback only "
                      "over TLS", f"set {API}.tls_cert_path and {API}.tls_key_path (PEM files), or bind_address: "
                      "127.0.0.1")
    elif len(missing) == 1:
        yield Finding(f"{API}.{missing[0]}", "TLS needs both the certificate and its key",
                      f"set {API}.{missing[0]} too, or neither (loopback only)")
    for name in ("tls_cert_path", "tls_key_path"):
        path = getattr(api, name)
        if path and not os.path.isfile(path):
            yield Finding(f"{API}.{name}", "is not a readable file", "point it at a PEM file")


def api_port(c: RuleContext) -> Iterator[Finding]:
    api, tracking = c.cfg.operator_api, c.cfg.tracking
    if api.enabled and api.port and api.port == tracking.prometheus_port:
        yield Finding(f"{API}.port", "is also tracking.prometheus_port", "choose another port, or 0 (any free one)")
