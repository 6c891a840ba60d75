"""Where a round's samples come from: the interface every round mode implements, and the on-policy one.

``GroupSampler`` asks its ``RoundSource`` for the next round and never looks at the mode again:

    OnPolicyRounds       (here)                      sampled now, with the weights that train on it (lag 0)
    FixedLagRounds       (asynchronous/rounds.py)    sampled ``lag`` rounds earlier, by an older version
    StreamingRounds      (asynchronous/rounds.py)    generated without pause, new weights between chunks

Every source ends in ``rollout/round.py``'s ``train_round`` with the trainer's current weights; they differ only
in when sampling ran and with which weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch

from gspo_lightning.engines.base import SamplingEngine
from gspo_lightning.rollout.round import RoundModel, RoundResult, RoundSettings, run_round
from gspo_lightning.rollout.types import PromptBatch
from gspo_lightning.strategies import inference_context


@dataclass(frozen=True)
class RoundRequest:
    """What a source needs to produce round ``index``.

    Attributes:
        trainer: the running trainer (its weights are version ``index``).
        index: the round (rollout index) about to train.
        batch: round ``index``'s prompts, as the dataloader served them.
        model: the round's ``RoundModel``, built on call (the module's parts as they are now).
        settings: the sampler's ``RoundSettings``.
        prompts_of: any round's prompts by index (``PromptDataModule.rollout_batch``; sources that sample ahead).
        seed_of: any round's sampling seed by index.
        draw_prompts: dynamic sampling's extra prompts (``PromptDataModule.draw_prompts``), else None.
        any_rank: this rank's "I want more" as all ranks' decision (sharded sampling is a collective).
    """

    trainer: pl.Trainer
    index: int
    batch: PromptBatch
    model: Callable[[], RoundModel]
    settings: RoundSettings
    prompts_of: Callable[[int], PromptBatch]
    seed_of: Callable[[int], int]
    draw_prompts: Callable[[], PromptBatch] | None = None
    any_rank: Callable[[bool], bool] = bool


@dataclass
class SourcedRound:
    """A round ready to train: the round itself, the source's figures (``rollout/``) and its seconds (``time/``)."""

    result: RoundResult
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class RoundSource(Protocol):
    """A round mode (see the module docstring)."""

    runs_in_background: bool
    """Whether sampling runs beside training, on an engine of its own (then it never runs the policy, and needs no
    sharded collective)."""

    seconds_logged: tuple[str, ...]
    """The ``time/`` figures it reports every round (logged as 0 on a round's later steps)."""

    def next_round(self, request: RoundRequest) -> SourcedRound:
        """Round ``request.index``, sampled as the mode says and trained-ready with the current weights."""
        ...

    def lend(self) -> AbstractContextManager[None]:
        """A context in which the engine may be used from the trainer's thread (the held-out evaluation)."""
        ...

    def state_dict(self) -> Any:
        """What a resumed run needs of this source (None: nothing)."""
        ...

    def load_state_dict(self, state: Any) -> None: ...

    def close(self) -> None:
        """Stop whatever runs in the background (a later fit starts afresh)."""
        ...


class OnPolicyRounds:
    """``sampler.asynchronous.mode: off``: every round sampled with the weights that train on it."""

    runs_in_background = False
    seconds_logged: tuple[str, ...] = ()

    def __init__(self, engine: SamplingEngine) -> None:
        self.engine = engine

    def next_round(self, request: RoundRequest) -> SourcedRound:
        trainer = request.trainer
        # Outside the inference context: under FSDP1 that holds the root's parameters gathered, and the engine's
        # weight sync gathers every unit itself.
        self.engine.before_rollout(trainer, trainer.lightning_module)
        model = request.model()
        with inference_context(trainer):
            result = run_round(
                self.engine, model, request.settings, request.batch, request.seed_of(request.index),
                draw_prompts=request.draw_prompts, any_rank=request.any_rank,
            )  # fmt: skip
        return SourcedRound(result)

    @contextmanager
    def lend(self) -> Iterator[None]:
        yield  # nothing runs beside the trainer

    def state_dict(self) -> None:
        return None

    def load_state_dict(self, state: Any) -> None:
        pass

    def close(self) -> None:
        pass
