"""Where the controller takes the pools' device from: its configuration's declaration, not its own node."""

from __future__ import annotations

import pytest

from libra import device


@pytest.fixture(autouse=True)
def undeclared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "_declared_logical_gpus", None)
    monkeypatch.delenv(device.FORCE_CPU_ENV, raising=False)


@pytest.mark.parametrize(("declared_logical", "local_cuda", "force_cpu", "expected"), [
    pytest.param(None, False, False, False, id="undeclared-follows-this-node-cpu"),
    pytest.param(None, True, False, True, id="undeclared-follows-this-node-cuda"),
    pytest.param(False, False, False, True, id="gpu-cluster-from-a-cpu-only-head"),
    pytest.param(True, True, False, False, id="logical-gpus-on-a-node-with-cuda"),
    pytest.param(False, True, True, False, id="force-cpu-wins-over-a-declared-gpu-cluster"),
    pytest.param(None, True, True, False, id="force-cpu-wins-over-this-node"),
])
def test_pools_on_cuda(monkeypatch: pytest.MonkeyPatch, declared_logical: bool | None, local_cuda: bool,
                       force_cpu: bool, expected: bool) -> None:
    monkeypatch.setattr(device, "cuda_available", lambda: local_cuda)
    if force_cpu:
        monkeypatch.setenv(device.FORCE_CPU_ENV, "1")
    if declared_logical is not None:
        device.declare_pools_device(declared_logical)
    assert device.pools_on_cuda() is expected
