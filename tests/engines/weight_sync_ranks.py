"""Gather the policy's weights for an engine under a 2-rank strategy, as the vLLM engine does before a round.

    python tests/engines/weight_sync_ranks.py --strategy fsdp2 --out weights
    python tests/engines/weight_sync_ranks.py --strategy fsdp2 --out weights --lora   # a LoRA policy, one step on

Each rank writes ``<out>.rank<r>.pt``: the gathered weights (every rank gets the full tensors), and the largest
group it held at once (in elements). With ``--lora`` the policy is a rank-4 LoRA on every linear layer, gathered
after one optimizer step (so the adapter is not the identity), three ways: ``merged``, ``base`` and ``adapter``
(``policy_weight_groups``' ``lora``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gspo_lightning.engines.weight_sync import policy_weight_groups  # noqa: E402
from gspo_lightning.models import LoRA, TinyQwen3  # noqa: E402
from gspo_lightning.process_group import close_process_group  # noqa: E402
from gspo_lightning.strategies import fsdp1_root  # noqa: E402
from tests.distributed.one_step import STRATEGIES, TINY, FixedBatches, SGDModule, global_minibatch  # noqa: E402


def _gathered(policy, root, lora: str) -> tuple[dict[str, torch.Tensor], int]:
    weights, largest = {}, 0
    with torch.no_grad():
        for group in policy_weight_groups(policy, root, lora=lora):
            largest = max(largest, sum(tensor.numel() for _, tensor in group))
            weights.update({name: tensor.detach().clone().cpu() for name, tensor in group})
    return weights, largest


class Gather(pl.Callback):
    out, lora = "", False

    def on_train_start(self, trainer, pl_module):
        if not self.lora:
            weights, largest = _gathered(pl_module.policy, fsdp1_root(trainer), "merged")
            torch.save({"weights": weights, "largest": largest}, f"{self.out}.rank{trainer.global_rank}.pt")

    def on_train_end(self, trainer, pl_module):
        if self.lora:
            saved = {kind: _gathered(pl_module.policy, fsdp1_root(trainer), kind)[0]
                     for kind in ("merged", "base", "adapter")}  # fmt: skip
            torch.save(saved, f"{self.out}.rank{trainer.global_rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--lora", action="store_true")
    args = parser.parse_args()
    loader = LoRA(TinyQwen3(**TINY), r=4, alpha=8) if args.lora else TinyQwen3(**TINY)
    module = SGDModule(policy=loader, objective="gspo", lr=0.5, log_entropy=False)
    gather = Gather()
    gather.out, gather.lora = args.out, args.lora
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=STRATEGIES[args.strategy](), max_steps=1, logger=False,
        use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[gather],
    )  # fmt: skip
    trainer.fit(module, datamodule=FixedBatches(global_minibatch(loader)))


if __name__ == "__main__":
    try:
        main()
    finally:
        close_process_group()  # as the CLI ends: without it gloo's exit race can abort a finished run
