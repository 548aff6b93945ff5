"""The CPU compatibility layer's device rewriting and RNG tracker (the global `install()` is exercised by the
integration tests inside the worker processes, not in the test runner)."""

from __future__ import annotations

import pytest
import torch

from libra.training import cpu_compat

CALLS = {
    "factory-device-string": lambda: torch.zeros(2, device="cuda"),
    "factory-device-index": lambda: torch.empty(2, device=0),
    "factory-device-object": lambda: torch.ones(2, device=torch.device("cuda", 0)),
    "tensor-cuda": lambda: torch.ones(2).cuda(),
    "tensor-to-cuda": lambda: torch.ones(2).to("cuda"),
    "tensor-to-cuda-with-dtype": lambda: torch.ones(2).to("cuda", torch.float64),
    "tensor-to-device-kwarg": lambda: torch.ones(2).to(device="cuda:0"),
    "pin-memory": lambda: torch.ones(2).pin_memory(),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is inactive where CUDA exists")
@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_device_mode_keeps_tensors_on_cpu(call) -> None:  # type: ignore[no-untyped-def]
    with cpu_compat.CpuDeviceMode():
        out = call()
    assert out.device.type == "cpu"


def test_device_mode_leaves_other_arguments_alone() -> None:
    with cpu_compat.CpuDeviceMode():
        out = torch.ones(2, dtype=torch.float16).to(torch.float32)
    assert out.dtype == torch.float32


def test_cpu_rng_tracker_forks_and_restores() -> None:
    tracker = cpu_compat._make_tracker_class()()
    torch.manual_seed(123)
    tracker.add("model-parallel-rng", 7)
    outside_before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside_before)
    with tracker.fork("model-parallel-rng"):
        second = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(first, torch.rand(3))  # the tracked stream starts at its seed ...
    assert not torch.equal(first, second)  # ... and advances across forks
    with pytest.raises(Exception, match="seed 7 already exists"):
        tracker.add("other", 7)
