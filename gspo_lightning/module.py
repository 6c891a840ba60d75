"""GSPOModule: the policy, its tokenizer and the GSPO (or GRPO) objective in ``training_step``.

One Lightning training step is one optimizer step on one minibatch of the current rollout batch; the sampler
callback fills ``batch.minibatch`` before the step. No second copy of the weights is kept for pi_old: the old
policy's per-token log-probs travel in the minibatch (see ``rollout/minibatches.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Literal

import lightning.pytorch as pl
import torch
from torch import Tensor

from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.models import PolicyLoader
from gspo_lightning.objectives import grpo_loss, gspo_loss
from gspo_lightning.rollout.types import PromptBatch
from gspo_lightning.validation import require

ObjectiveFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]
OBJECTIVES: dict[str, ObjectiveFn] = {"gspo": gspo_loss, "grpo": grpo_loss}
# The policy stays in eval mode on purpose (see configure_model); Lightning's notice about it is noise here.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")

PAPER_CLIP_RANGES = {"gspo": (3e-4, 4e-4), "grpo": (0.2, 0.27)}
"""(eps_low, eps_high) used in the paper's section 5.1 for each objective."""


class GSPOModule(pl.LightningModule):
    """Trains a Hugging Face causal LM with GSPO (Eqs. 5, 7) or the GRPO baseline (Eq. 2).

    Args:
        policy: how to build the policy and its tokenizer (``Pretrained``, ``TinyQwen3``,
            ``WarmStartedTinyQwen3`` or your own ``PolicyLoader``).
        objective: ``gspo`` (sequence-level ratio and clipping) or ``grpo`` (token-level).
        eps_low: lower clipping range, ratio clipped at 1 - eps_low (default: the paper's value for the
            objective: 3e-4 for gspo, 0.2 for grpo).
        eps_high: upper clipping range, ratio clipped at 1 + eps_high (default: 4e-4 for gspo, 0.27 for grpo).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear learning-rate warm-up, in optimizer steps; constant afterwards.
        temperature: temperature of the log-probs; linked to the sampler's sampling temperature by the CLI.
    """

    def __init__(
        self,
        policy: PolicyLoader,
        objective: Literal["gspo", "grpo"] = "gspo",
        eps_low: float | None = None,
        eps_high: float | None = None,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        temperature: float = 1.0,
    ) -> None:
        super().__init__()
        if objective not in OBJECTIVES:
            raise ValueError(f"model.objective must be one of {sorted(OBJECTIVES)}, got {objective!r}")
        default_low, default_high = PAPER_CLIP_RANGES[objective]
        self.eps_low = default_low if eps_low is None else eps_low
        self.eps_high = default_high if eps_high is None else eps_high
        _validate(self.eps_low, self.eps_high, lr, weight_decay, warmup_steps, temperature)
        self.save_hyperparameters()
        self.objective_fn = OBJECTIVES[objective]
        self.policy_loader = policy
        self.tokenizer = policy.load_tokenizer()
        self.policy: torch.nn.Module | None = None

    def configure_model(self) -> None:
        """Build the policy here, not in ``__init__``, so sharded strategies can wrap it as it is created."""
        if self.policy is not None:
            return
        # Eval mode for good: dropout off, so pi_old and pi_theta are the same deterministic function of the
        # weights and the first minibatch of every round is exactly on-policy (ratio 1).
        self.policy = self.policy_loader.load_model(self.tokenizer).eval()

    def on_fit_start(self) -> None:
        self.policy.eval()

    def training_step(self, batch: PromptBatch, batch_idx: int) -> Tensor:
        minibatch = batch.minibatch
        if minibatch is None:
            raise RuntimeError("training_step got no minibatch: add gspo_lightning.GroupSampler to the callbacks")
        logprobs = response_logprobs(
            self.policy,
            minibatch.input_ids,
            minibatch.attention_mask,
            minibatch.response_ids.shape[1],
            self.hparams.temperature,
        )  # [n, R]
        loss, stats = self.objective_fn(
            logprobs,
            minibatch.old_logprobs,
            minibatch.advantages,
            minibatch.response_mask,
            self.eps_low,
            self.eps_high,
        )
        size = len(minibatch)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=size)
        self.log_dict({f"train/{name}": value for name, value in stats.items()}, batch_size=size)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        warmup = max(self.hparams.warmup_steps, 1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _validate(
    eps_low: float, eps_high: float, lr: float, weight_decay: float, warmup_steps: int, temperature: float
) -> None:
    require(0 < eps_low < 1, f"model.eps_low must be in (0, 1), got {eps_low}")
    require(0 < eps_high < 1, f"model.eps_high must be in (0, 1), got {eps_high}")
    require(lr > 0, f"model.lr must be > 0, got {lr}")
    require(weight_decay >= 0, f"model.weight_decay must be >= 0, got {weight_decay}")
    require(warmup_steps >= 0, f"model.warmup_steps must be >= 0, got {warmup_steps}")
    require(temperature > 0, f"model.temperature must be > 0, got {temperature}")
