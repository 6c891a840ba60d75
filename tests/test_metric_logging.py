"""Each logged figure is reduced across ranks with the operation that fits its meaning."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gspo_lightning.metric_logging import StepMetrics, cross_rank_reduction, log_across_ranks


@pytest.mark.parametrize(
    ("name", "reduction"),
    [
        ("train/loss", "mean"),
        ("rollout/reward_mean", "mean"),
        ("diag/seq_ratio_p95", "mean"),
        ("train/ratio_max", "max"),
        ("rollout/response_len_max", "max"),
        ("diag/abs_log_seq_ratio_max", "max"),
        ("train/ratio_min", "min"),
        ("rollout/no_signal", "min"),
        ("time/generate_s", "max"),
        ("train/num_empty", "sum"),
        ("rollout/prompts_skipped", "sum"),
        ("rollout/reward_errors", "sum"),
    ],
)
def test_cross_rank_reduction_follows_the_meaning(name, reduction):
    assert cross_rank_reduction(name) == reduction


class Recorder:
    """A module as log_across_ranks sees it: ``trainer`` (None: not attached), ``log``, maybe ``step_metrics``."""

    def __init__(self, trainer=None, queue: StepMetrics | None = None) -> None:
        self.trainer = trainer
        self.calls = []
        if queue is not None:
            self.step_metrics = queue

    def log(self, name, value, **kwargs):
        self.calls.append((name, value, kwargs.get("reduce_fx")))


class Logger:
    def __init__(self) -> None:
        self.calls = []

    def log_metrics(self, metrics, step):
        self.calls.append((step, metrics))


def fake_trainer(world_size: int, every: int = 1, other_rank: list[float] | None = None):
    """What StepMetrics.write uses of a Trainer; ``all_gather`` adds a second rank holding ``other_rank``."""
    strategy = SimpleNamespace(
        root_device=torch.device("cpu"), all_gather=lambda values: torch.stack([values, torch.tensor(other_rank)])
    )
    return SimpleNamespace(
        world_size=world_size, strategy=strategy, loggers=[Logger()], log_every_n_steps=every, callback_metrics={}
    )


def test_a_module_without_step_metrics_logs_through_module_log_with_the_reduction():
    for trainer in (None, fake_trainer(world_size=1)):
        module = Recorder(trainer)
        log_across_ranks(module, {"train/loss": 1.0, "train/ratio_max": 2.0}, batch_size=8)
        assert module.calls == [("train/loss", 1.0, "mean"), ("train/ratio_max", 2.0, "max")]


def test_a_steps_figures_are_written_once_reduced_across_ranks():
    trainer = fake_trainer(world_size=2, other_rank=[3.0, 1.0, 5.0, 0.5])
    module = Recorder(trainer, StepMetrics())
    log_across_ranks(module, {"train/loss": torch.tensor(1.0), "train/ratio_max": 2.0})
    log_across_ranks(module, {"train/num_empty": 1, "train/ratio_min": torch.tensor(0.25)})
    assert trainer.loggers[0].calls == [] and module.calls == []  # held until the end of the step
    assert trainer.callback_metrics["train/loss"].item() == 1.0  # callbacks see this rank's value meanwhile
    module.step_metrics.write(trainer, step=7)
    written = {"train/loss": 2.0, "train/ratio_max": 2.0, "train/num_empty": 6.0, "train/ratio_min": 0.25}
    assert trainer.loggers[0].calls == [(7, written)]  # one call: mean, max, sum, min over the two ranks
    assert {name: value.item() for name, value in trainer.callback_metrics.items()} == written
    module.step_metrics.write(trainer, step=7)
    assert len(trainer.loggers[0].calls) == 1  # emptied by the write


@pytest.mark.parametrize(("step", "written"), [(3, True), (4, False)])
def test_log_every_n_steps_selects_the_logged_steps_but_callbacks_see_every_step(step, written):
    trainer = fake_trainer(world_size=1, every=2)
    queue = StepMetrics()
    log_across_ranks(Recorder(trainer, queue), {"rollout/reward_mean": 0.5})
    queue.write(trainer, step)
    assert trainer.loggers[0].calls == ([(step, {"rollout/reward_mean": 0.5})] if written else [])
    assert trainer.callback_metrics["rollout/reward_mean"].item() == 0.5
