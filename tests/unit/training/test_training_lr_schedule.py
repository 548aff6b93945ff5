"""`optimizer.lr_decay_style`, `min_lr`, `lr_warmup_steps` and `total_steps` shape the learning rate that
Megatron-Core's real `OptimizerParamScheduler` applies, stepped once per training step as the workers do."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from libra.config.mapping import config_with, training_pool_spec
from libra.training.megatron_setup import scheduler_kwargs

LR, MIN_LR, STEPS, WARMUP = 1e-3, 1e-4, 20, 4


def _lrs(style: str, min_lr: float = MIN_LR, warmup: int = WARMUP) -> list[float]:
    cfg = config_with("/m", total_steps=STEPS, optimizer={"lr": LR, "min_lr": min_lr, "lr_warmup_steps": warmup,
                                                          "lr_decay_style": style})
    spec = training_pool_spec(cfg, num_gpus=1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = OptimizerParamScheduler(optimizer, **scheduler_kwargs(spec.optimizer))
    seen = []
    for _ in range(STEPS):
        seen.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    seen.append(optimizer.param_groups[0]["lr"])
    return seen


def _cosine(step: int) -> float:
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (math.cos(math.pi * progress) + 1)


@pytest.mark.parametrize(
    ("style", "expected_at"),
    [
        ("constant", lambda s: LR),
        ("linear", lambda s: MIN_LR + (LR - MIN_LR) * (STEPS - s) / (STEPS - WARMUP)),
        ("cosine", _cosine),
    ],
    ids=["constant", "linear", "cosine"],
)
def test_schedule_after_warmup(style: str, expected_at) -> None:  # type: ignore[no-untyped-def]
    lrs = _lrs(style)
    assert lrs[WARMUP // 2] == pytest.approx(LR * (WARMUP // 2) / WARMUP)  # linear warm-up from 0
    for step in range(WARMUP, STEPS + 1):
        assert lrs[step] == pytest.approx(expected_at(step), rel=1e-6), step
    if style != "constant":
        assert lrs[STEPS] == pytest.approx(MIN_LR)


def test_no_warmup_starts_at_lr() -> None:
    assert _lrs("linear", warmup=0)[0] == pytest.approx(LR)
