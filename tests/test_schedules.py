"""The learning-rate schedules, step by step against hand-computed factors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from gspo_lightning.resume import apply_configured_settings, optimizer_settings
from gspo_lightning.schedules import CosineWithWarmup, LinearWarmup


def _rates(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


def _optimizer(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_linear_warmup_rises_over_its_steps_then_holds():
    assert _rates(LinearWarmup(_optimizer(0.4), warmup_steps=4), 6) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])
    assert _rates(LinearWarmup(_optimizer(0.4), warmup_steps=0), 3) == pytest.approx([0.4] * 3)  # constant


def test_cosine_with_warmup_decays_to_its_floor_and_stays():
    rates = _rates(CosineWithWarmup(_optimizer(), warmup_steps=2, total_steps=6, min_factor=0.2), 9)
    cosine = [0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]  # steps 2..6
    assert rates == pytest.approx([0.5, 1.0, *cosine, 0.2, 0.2])


def test_a_schedule_resumes_where_it_stopped():
    first = CosineWithWarmup(_optimizer(), warmup_steps=2, total_steps=8)
    _rates(first, 5)
    resumed = CosineWithWarmup(_optimizer(), warmup_steps=2, total_steps=8)
    resumed.load_state_dict(first.state_dict())
    resumed.optimizer.param_groups[0]["lr"] = first.optimizer.param_groups[0]["lr"]
    assert _rates(resumed, 3) == pytest.approx(_rates(first, 3))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda o: LinearWarmup(o, warmup_steps=-1), r"lr_scheduler.init_args.warmup_steps must be an integer >= 0"),
        (lambda o: CosineWithWarmup(o, warmup_steps=5, total_steps=5), r"total_steps must be an integer > warmup"),
        (lambda o: CosineWithWarmup(o, total_steps=5, min_factor=2.0), r"min_factor must be in \[0, 1\], got 2.0"),
    ],
)
def test_bad_schedule_settings_name_the_setting(make, message):
    with pytest.raises(ValueError, match=message):
        make(_optimizer())


def test_a_resumed_optimizer_takes_the_configured_settings_at_the_schedules_position():
    saved = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-4, betas=(0.9, 0.999))
    scheduler = LinearWarmup(saved, warmup_steps=10)
    for _ in range(3):
        saved.step()
        scheduler.step()  # step 3 of the warm-up: lr 4e-5
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-4, betas=(0.9, 0.95))
    LinearWarmup(fresh, warmup_steps=10)
    trainer = SimpleNamespace(optimizers=[saved], lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])
    apply_configured_settings(trainer, [optimizer_settings(fresh)])
    group = saved.param_groups[0]
    assert group["lr"] == pytest.approx(3e-4 * 4 / 10) and group["initial_lr"] == 3e-4
    assert group["betas"] == (0.9, 0.95) and scheduler.base_lrs == [3e-4]
    saved.step()
    scheduler.step()
    assert group["lr"] == pytest.approx(3e-4 * 5 / 10)  # the warm-up goes on from the new base rate
