"""HeldOutEvaluation: greedy accuracy on the held-out prompts, at step 0, every n steps and at the end."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torchmetrics import MeanMetric

from gspo_lightning.rewards.scoring import score_completions
from gspo_lightning.rollout.context import inference_context, parameters_are_sharded
from gspo_lightning.rollout.generation import (
    SamplingSettings,
    decode_responses,
    encode_prompts,
    generate_responses,
    response_mask_until_eos,
)
from gspo_lightning.rollout.prompts import PROMPT_OVERFLOWS, PromptOverflow, context_length, fit_prompts_to_context
from gspo_lightning.validation import require


class HeldOutEvaluation(Callback):
    """Measures greedy accuracy on the data module's held-out prompts and logs it as ``eval/accuracy``.

    The data module must provide ``heldout_dataloader()`` yielding ``PromptBatch`` objects (each rank its own
    share: the metric is reduced across ranks by torchmetrics).

    Args:
        correct: a reward function returning 1.0 for a correct completion and 0.0 otherwise.
        every_n_steps: also evaluate every n optimizer steps (0: only at the start and the end).
        at_start: evaluate before the first update (step 0).
        at_end: evaluate after the last update.
        max_new_tokens: longest greedy response.
        prompt_overflow: a prompt whose tokens plus ``max_new_tokens`` exceed the policy's context: ``error``
            stops, ``truncate`` keeps its last tokens (as the sampler does), ``skip`` truncates it and leaves it
            out of the accuracy.
    """

    def __init__(
        self,
        correct: Callable[..., list[float]],
        every_n_steps: int = 0,
        at_start: bool = True,
        at_end: bool = True,
        max_new_tokens: int = 256,
        prompt_overflow: PromptOverflow = "error",
    ) -> None:
        require(every_n_steps >= 0, f"evaluation.every_n_steps must be >= 0 (0 disables it), got {every_n_steps}")
        require(max_new_tokens >= 1, f"evaluation.max_new_tokens must be >= 1, got {max_new_tokens}")
        require(
            prompt_overflow in PROMPT_OVERFLOWS,
            f"evaluation.prompt_overflow must be one of {list(PROMPT_OVERFLOWS)}, got {prompt_overflow!r}",
        )
        self.prompt_overflow = prompt_overflow
        self.correct = correct
        self.every_n_steps = every_n_steps
        self.at_start = at_start
        self.at_end = at_end
        self.settings = SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.0)
        self.history: list[tuple[int, float]] = []
        """(global step, accuracy) of every evaluation so far, resumed runs included."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not callable(getattr(trainer.datamodule, "heldout_dataloader", None)):
            raise AttributeError(
                "HeldOutEvaluation needs a data module with heldout_dataloader() (e.g. PromptDataModule)"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A resumed run does not start at step 0: its step-0 figure is in the restored history.
        if self.at_start and trainer.global_step == 0 and not self._evaluated_at(0):
            self.evaluate(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.every_n_steps and step % self.every_n_steps == 0 and not self._evaluated_at(step):
            self.evaluate(trainer, pl_module)
        if self.history:
            pl_module.log("acc", self.history[-1][1], prog_bar=True, logger=False, batch_size=1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_end and not self._evaluated_at(trainer.global_step):
            self.evaluate(trainer, pl_module)

    def _evaluated_at(self, step: int) -> bool:
        return bool(self.history) and self.history[-1][0] == step

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float:
        """Greedy-decode every held-out prompt of this rank, score it, reduce across ranks, log, record."""
        accuracy = MeanMetric().to(pl_module.device)
        synced = parameters_are_sharded(trainer)
        with inference_context(trainer):
            for batch in trainer.datamodule.heldout_dataloader():
                prompt_ids, prompt_mask = encode_prompts(pl_module.tokenizer, batch.prompts, pl_module.device)
                prompt_ids, prompt_mask, cut = fit_prompts_to_context(
                    prompt_ids,
                    prompt_mask,
                    self.settings.max_new_tokens,
                    context_length(pl_module.policy, pl_module.tokenizer),
                    self.prompt_overflow,
                    setting="evaluation.prompt_overflow",
                )  # [P, Lp'], [P, Lp'], [P]
                response_ids = generate_responses(
                    pl_module.policy, pl_module.tokenizer, prompt_ids, prompt_mask, self.settings, synced
                )  # [P, R]
                response_mask, _ = response_mask_until_eos(response_ids, pl_module.tokenizer.eos_token_id)
                completions = decode_responses(pl_module.tokenizer, response_ids, response_mask)
                scores, _ = score_completions([self.correct], [1.0], batch.prompts, completions, batch.columns)
                counted = (~cut if self.prompt_overflow == "skip" else torch.ones_like(cut)).cpu()  # [P] bool
                if bool(counted.any()):
                    accuracy.update(scores[counted].to(pl_module.device))
        value = float(accuracy.compute())
        self.history.append((trainer.global_step, value))
        for logger in trainer.loggers:
            logger.log_metrics({"eval/accuracy": value}, step=trainer.global_step)
        return value

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [tuple(item) for item in state_dict["history"]]
