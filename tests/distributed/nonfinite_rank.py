"""Three optimizer steps under a 2-rank strategy where only rank 1's minibatch yields a NaN loss at step 1.

    python tests/distributed/nonfinite_rank.py --strategy ddp --out sums

Each rank writes ``<out>.rank<r>.json``: a float64 checksum of the (full) policy weights after every step. A
correct run finishes (no rank waits for a collective the other skipped), leaves the weights unchanged at the
poisoned step on both ranks, and keeps the replicas equal.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gspo_lightning.callbacks.export import gather_policy_state_dict  # noqa: E402
from gspo_lightning.models import TinyQwen3  # noqa: E402
from gspo_lightning.process_group import close_process_group  # noqa: E402
from gspo_lightning.rollout.types import Minibatch, PromptBatch  # noqa: E402
from gspo_lightning.strategies import parameters_are_sharded  # noqa: E402
from tests.distributed.one_step import RESPONSES, STRATEGIES, TINY, SGDModule, global_minibatch  # noqa: E402

POISONED_STEP = 1


class NaNOnRankOne(SGDModule):
    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.global_step == POISONED_STEP:
            nan = torch.full_like(batch.minibatch.advantages, float("nan"))
            batch.minibatch = replace(batch.minibatch, advantages=nan)
        return super().training_step(batch, batch_idx)


class Checksums(pl.Callback):
    def __init__(self) -> None:
        self.sums: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if parameters_are_sharded(trainer):
            state = gather_policy_state_dict(trainer, pl_module)  # full on rank 0, a collective on every rank
        else:
            state = pl_module.policy.state_dict()
        self.sums.append(sum(float(t.double().sum()) for t in state.values()) if state else float("nan"))


class ThreeBatches(pl.LightningDataModule):
    def __init__(self, minibatch: Minibatch) -> None:
        super().__init__()
        self.minibatch = minibatch

    def train_dataloader(self):
        share = RESPONSES // self.trainer.world_size
        rows = slice(self.trainer.global_rank * share, (self.trainer.global_rank + 1) * share)
        part = Minibatch(**{name: value[rows] for name, value in self.minibatch.tensors().items()})
        batches = [PromptBatch(prompts=["p"] * share, columns={}, minibatch=part) for _ in range(3)]
        return DataLoader(batches, batch_size=None, collate_fn=lambda item: item)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    loader = TinyQwen3(**TINY)
    module = NaNOnRankOne(policy=loader, objective="grpo", lr=0.01, log_entropy=False)  # no token clips
    checksums = Checksums()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=STRATEGIES[args.strategy](), max_steps=3, logger=False,
        use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[checksums],
    )  # fmt: skip
    trainer.fit(module, datamodule=ThreeBatches(global_minibatch(loader)))
    counted = float(trainer.callback_metrics["faults/nonfinite_loss"])  # the last step's: 0
    Path(f"{args.out}.rank{trainer.global_rank}.json").write_text(json.dumps({"sums": checksums.sums, "last": counted}))


if __name__ == "__main__":
    try:
        main()
    finally:
        close_process_group()  # as the CLI ends: without it gloo's exit race can abort a finished run
