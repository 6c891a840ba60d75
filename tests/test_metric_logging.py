"""Each logged figure is reduced across ranks with the operation that fits its meaning."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gspo_lightning.metric_logging import cross_rank_reduction, log_across_ranks


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
    def __init__(self, world_size: int | None) -> None:
        self._trainer = None if world_size is None else SimpleNamespace(world_size=world_size)
        self.calls = []

    def log(self, name, value, **kwargs):
        self.calls.append((name, kwargs))


@pytest.mark.parametrize(("world_size", "synced"), [(None, False), (1, False), (2, True)])
def test_values_are_synced_only_when_there_are_several_ranks(world_size, synced):
    module = Recorder(world_size)
    log_across_ranks(module, {"train/loss": 1.0, "train/ratio_max": 2.0}, batch_size=8, prog_bar=True)
    assert module.calls == [
        ("train/loss", dict(batch_size=8, sync_dist=synced, reduce_fx="mean", prog_bar=True)),
        ("train/ratio_max", dict(batch_size=8, sync_dist=synced, reduce_fx="max", prog_bar=True)),
    ]
