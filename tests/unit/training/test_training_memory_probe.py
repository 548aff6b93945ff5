"""libra.training.memory_probe on the CPU: transient peaks of tracked work and resident state by storage."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from libra.training.memory_probe import measure_peak, resident_bytes, transient_peak  # noqa: E402


def test_transient_peak_counts_what_the_work_allocates_at_once() -> None:
    def work() -> None:
        a = torch.empty(1000, dtype=torch.float32)
        b = torch.empty(500, dtype=torch.float32)
        del a, b

    assert transient_peak(work, []) == 1500 * 4


def test_a_module_run_twice_in_one_call_is_measured() -> None:
    """A schedule runs the model once per micro-batch inside one measured call."""
    model = torch.nn.Linear(8, 8)

    def two_micro_batches() -> None:
        for _ in range(2):
            model(torch.ones(4, 8)).sum().backward()

    result = measure_peak(two_micro_batches, [model])
    assert result["added_peak_bytes"] > 0


def test_optimizer_state_is_resident_not_transient() -> None:
    model = torch.nn.Linear(16, 16, bias=False)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.ones(2, 16)).sum().backward()
    optimizer.step()  # creates the two moments
    resident = resident_bytes([model], optimizer)
    weight = 16 * 16 * 4
    assert resident["weights"] == weight and resident["gradients"] == weight
    assert resident["optimizer_state"] == 2 * weight + 4  # exp_avg, exp_avg_sq and the fp32 step
    # one step of unfused AdamW needs temporaries, not a second copy of its state
    assert 0 < transient_peak(optimizer.step, [model], optimizer) < 2 * weight + 4
