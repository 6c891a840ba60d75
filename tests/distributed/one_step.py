"""One optimizer step on a fixed global minibatch, under a chosen strategy; rank 0 saves the policy's weights.

Run as a script (Lightning relaunches it for ranks > 0):

    python tests/distributed/one_step.py --strategy ddp --devices 2 --out step.pt

The global minibatch (8 responses) is the same for every strategy; with 2 ranks each trains on its half, so a
correct data-parallel step (gradients averaged across ranks, clipping by the global norm) equals the
single-process step on all 8. The optimizer is plain SGD so that a wrong gradient scale shows (Adam's first
step would hide it).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gspo_lightning import GSPOModule  # noqa: E402
from gspo_lightning.callbacks.export import ExportPolicy, gather_policy_state_dict  # noqa: E402
from gspo_lightning.logprobs import response_logprobs  # noqa: E402
from gspo_lightning.models import TinyQwen3  # noqa: E402
from gspo_lightning.process_group import close_process_group  # noqa: E402
from gspo_lightning.rollout.types import Minibatch, PromptBatch  # noqa: E402
from gspo_lightning.strategies import (  # noqa: E402
    DecoderLayerFSDP,
    DecoderLayerFSDP2,
    parameters_are_sharded,  # noqa: E402
)

TINY = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
RESPONSES, PROMPT_LEN, RESPONSE_LEN = 8, 6, 5


def global_minibatch(loader: TinyQwen3) -> Minibatch:
    """Fixed random prompts and responses with mixed lengths; pi_old = the initial policy, slightly perturbed."""
    generator = torch.Generator().manual_seed(1)
    vocab = len(loader.load_tokenizer())
    prompt = torch.randint(3, vocab, (RESPONSES, PROMPT_LEN), generator=generator)  # [N, Lp]
    response = torch.randint(3, vocab, (RESPONSES, RESPONSE_LEN), generator=generator)  # [N, R]
    lengths = torch.tensor([5, 3, 4, 1, 5, 2, 5, 4])  # [N]
    response_mask = (torch.arange(RESPONSE_LEN) < lengths[:, None]).float()  # [N, R]
    prompt_mask = torch.ones(RESPONSES, PROMPT_LEN)
    prompt_mask[1, :2] = 0  # left padding
    input_ids = torch.cat([prompt, response], 1)  # [N, L]
    attention_mask = torch.cat([prompt_mask, response_mask], 1)  # [N, L]
    policy = loader.load_model(loader.load_tokenizer()).eval()
    with torch.no_grad():
        current = response_logprobs(policy, input_ids, attention_mask, RESPONSE_LEN)  # [N, R]
    old = current + 1e-4 * torch.randn(current.shape, generator=generator)  # inside and outside the clip range
    advantages = torch.randn(RESPONSES, generator=generator)  # [N]
    return Minibatch(input_ids, attention_mask, response, response_mask, old, advantages, advantages.clone())


class SGDModule(GSPOModule):
    """GSPOModule with plain SGD (``lr`` given): a step is then a known function of the gradient."""

    def __init__(self, lr: float, **kwargs) -> None:
        super().__init__(optimizer=functools.partial(torch.optim.SGD, lr=lr), **kwargs)


class FixedBatches(pl.LightningDataModule):
    def __init__(self, minibatch: Minibatch) -> None:
        super().__init__()
        self.minibatch = minibatch

    def train_dataloader(self):
        world, rank = self.trainer.world_size, self.trainer.global_rank
        share = RESPONSES // world
        rows = slice(rank * share, (rank + 1) * share)
        part = Minibatch(**{name: value[rows] for name, value in self.minibatch.tensors().items()})
        batch = PromptBatch(prompts=["p"] * share, columns={}, minibatch=part)
        return DataLoader([batch], batch_size=None, collate_fn=lambda item: item)


STRATEGIES = {
    "single": lambda: "auto",
    "ddp": lambda: "ddp",
    "fsdp1": lambda: DecoderLayerFSDP(state_dict_type="full"),
    "fsdp2": lambda: DecoderLayerFSDP2(),
    "fsdp1_checkpointing": lambda: DecoderLayerFSDP(state_dict_type="full", activation_checkpointing=True),
    "fsdp2_checkpointing": lambda: DecoderLayerFSDP2(activation_checkpointing=True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--export", default=None, help="also export the policy here with ExportPolicy")
    parser.add_argument("--module-checkpointing", action="store_true", help="model.activation_checkpointing")
    parser.add_argument("--packing", action="store_true", help="model.packing")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="model.micro_batch_tokens")
    args = parser.parse_args()
    loader = TinyQwen3(**TINY)
    module = SGDModule(
        policy=loader, objective="gspo", lr=0.5, log_entropy=False, activation_checkpointing=args.module_checkpointing,
        packing=args.packing, micro_batch_tokens=args.micro_batch_tokens, max_new_tokens=RESPONSE_LEN,
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=STRATEGIES[args.strategy](),
        max_steps=1,
        gradient_clip_val=args.clip or None,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ExportPolicy(args.export, enabled=args.export is not None)],
    )
    trainer.fit(module, datamodule=FixedBatches(global_minibatch(loader)))
    wrapped = [m for m in trainer.strategy.model.modules() if isinstance(m, CheckpointWrapper)]
    checkpointed = "checkpointing" in args.strategy or args.module_checkpointing
    assert len(wrapped) == (TINY["num_layers"] if checkpointed else 0), wrapped
    if parameters_are_sharded(trainer):
        state = gather_policy_state_dict(trainer, module)
    else:
        state = {name: tensor.detach().clone() for name, tensor in module.policy.state_dict().items()}
    if trainer.is_global_zero:
        torch.save(state, args.out)


if __name__ == "__main__":
    try:
        main()
    finally:
        close_process_group()  # as the CLI ends: without it gloo's exit race can abort a finished run
