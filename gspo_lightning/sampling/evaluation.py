"""HeldOutEvaluation: greedy accuracy or sampled pass@k on the held-out prompts, at step 0, every n steps and
at the end."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from gspo_lightning.engines import EngineName, SamplingEngine, resolve_engine
from gspo_lightning.engines.base import RoundNeed, SamplingSettings
from gspo_lightning.episodes.rewards import environment_reward
from gspo_lightning.episodes.settings import EpisodeSettings
from gspo_lightning.metrics import PassAtK
from gspo_lightning.rollout.checks import check_data_columns, round_need, validate_evaluation
from gspo_lightning.rollout.data_contract import DataSide
from gspo_lightning.rollout.trajectories import sample_and_score_trajectories, trajectory_run
from gspo_lightning.rollout.pipeline import PromptOverflow, Scoring, context_length
from gspo_lightning.sampling.sampler import GroupSampler
from gspo_lightning.validation import SettingError
from gspo_lightning.rollout.state import evaluation_seed, isolated_rng
from gspo_lightning.rollout.stats import episode_stats
from gspo_lightning.rollout.types import PromptBatch
from gspo_lightning.strategies import inference_context, parameters_are_sharded


class HeldOutEvaluation(Callback):
    """Measures the policy on the data module's held-out prompts: greedy accuracy, or sampled pass@k.

    With ``samples_per_prompt`` 1 (the default) each prompt is decoded once, greedily, and ``eval/accuracy`` is
    the fraction solved. With n = ``samples_per_prompt`` > 1 each prompt is sampled n times (at
    ``temperature``/``top_p``/``top_k``) and, for each k of ``pass_k``, ``eval/pass@<k>`` is the unbiased
    estimate of pass@k from n samples (Chen et al. 2021); ``eval/accuracy`` is then pass@1, the mean fraction
    of solved samples. The sampling draws from generators seeded by (``seed``, global step, rank) and restored
    afterwards: it never moves the training run's random stream, and a resumed run redraws the same samples.

    The data module must provide ``heldout_dataloader()`` yielding ``PromptBatch`` objects (each rank its own
    share: the metrics are reduced across ranks by torchmetrics). When the training sampler rolls out multi-turn
    episodes (``sampler.episodes``), the held-out prompts are episodes too (the same tools or environment and
    limits), ``correct`` scores their final answers, and ``eval/turns_mean`` and ``eval/tool_calls_mean`` are
    logged.

    Args:
        correct: a reward function scoring each completion; a completion is solved when its score is >=
            ``solved_at`` (e.g. 1.0 from an exact-answer check, or the fraction of unit tests passed). Unset for
            episodes with an environment (``sampler.episodes.environment``): the environment's reward
            (``gspo_lightning.episodes.environment_reward``); required otherwise.
        every_n_steps: also evaluate every n optimizer steps (0: only at the start and the end).
        at_start: evaluate before the first update (step 0).
        at_end: evaluate after the last update.
        max_new_tokens: longest held-out response (null, the default: the module's ``model.max_new_tokens``, the
            training responses' budget).
        prompt_overflow: a prompt whose tokens plus ``max_new_tokens`` exceed the policy's context: ``error``
            stops, ``truncate`` keeps its last tokens (as the sampler does), ``skip`` truncates it and leaves it
            out of the metrics.
        samples_per_prompt: n, responses per held-out prompt. 1: one greedy decode (``eval/accuracy`` only);
            > 1: n samples, generated in one batch of (eval batch size x n) rows (lower the data module's
            ``eval_batch_size`` if that does not fit in memory).
        temperature: sampling temperature (> 0), used only when ``samples_per_prompt`` > 1.
        top_p: nucleus sampling threshold in (0, 1], used only when ``samples_per_prompt`` > 1.
        top_k: top-k sampling (0 disables it), used only when ``samples_per_prompt`` > 1.
        pass_k: the k's logged as ``eval/pass@<k>`` when ``samples_per_prompt`` > 1; each in
            [1, samples_per_prompt].
        solved_at: the ``correct`` score from which a completion counts as solved.
        seed: seeds the evaluation's sampling together with the global step and the rank.
        engine: what samples the held-out responses: None (default) the training sampler's engine (a
            ``GroupSampler`` among the trainer's callbacks; else ``hf``), or an engine of its own (``hf``, ``vllm``,
            ``{class_path: ..., init_args: ...}``).
    """

    def __init__(
        self,
        correct: Callable[..., list[float]] | None = None,
        every_n_steps: int = 0,
        at_start: bool = True,
        at_end: bool = True,
        max_new_tokens: int | None = None,
        prompt_overflow: PromptOverflow = "error",
        samples_per_prompt: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        pass_k: Sequence[int] = (1,),
        solved_at: float = 1.0,
        seed: int = 0,
        engine: SamplingEngine | EngineName | None = None,
    ) -> None:
        validate_evaluation(every_n_steps, max_new_tokens, prompt_overflow, samples_per_prompt, temperature, top_p,
                            top_k, pass_k, solved_at, seed)  # fmt: skip
        self.prompt_overflow = prompt_overflow
        self.correct = correct
        self.every_n_steps = every_n_steps
        self.at_start = at_start
        self.at_end = at_end
        self.samples_per_prompt = samples_per_prompt
        self.pass_k = tuple(pass_k)
        self.solved_at = solved_at
        self.seed = seed
        self.max_new_tokens = max_new_tokens
        self.sampling = (temperature, top_p, top_k)
        self.history: list[tuple[int, float]] = []
        """(global step, accuracy) of every evaluation so far, resumed runs included."""
        self.engine = None if engine is None else resolve_engine(engine, "evaluation.engine")
        self._engine: SamplingEngine | None = self.engine
        self._episode_figures: list[dict[str, Tensor]] = []

    @property
    def description(self) -> str:
        """What ``eval/accuracy`` measures, for summaries."""
        if self.samples_per_prompt == 1:
            return "held-out greedy accuracy"
        return f"held-out pass@1 ({self.samples_per_prompt} samples per prompt, temperature {self.sampling[0]})"

    def sampling_settings(self, pl_module: pl.LightningModule) -> SamplingSettings:
        """Greedy (``samples_per_prompt`` 1) or sampled, up to ``max_new_tokens`` (else the module's)."""
        budget = self.max_new_tokens if self.max_new_tokens is not None else getattr(pl_module, "max_new_tokens", None)
        if budget is None:
            raise SettingError("evaluation.max_new_tokens is null and the LightningModule has no max_new_tokens: "
                               "set one")  # fmt: skip
        if self.samples_per_prompt == 1:
            return SamplingSettings(max_new_tokens=budget, temperature=0.0)
        return SamplingSettings(budget, *self.sampling)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # after the data module's setup, before configure_model builds the policy
            check_data_columns(DataSide(trainer.datamodule), [self.correct_for(trainer)], "eval", "evaluation.correct")

    def correct_for(self, trainer: pl.Trainer) -> Callable[..., list[float]]:
        """``correct``; unset, what scores the sampler's episodes' environment (see :func:`default_correct`)."""
        if self.correct is not None:
            return self.correct
        sampler = _training_sampler(trainer)
        return default_correct(sampler.episodes if sampler is not None else None)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        data = DataSide(trainer.datamodule)
        data.needs("heldout_dataloader", "evaluation (HeldOutEvaluation)")
        engine = self._engine_of(trainer)
        engine.reserve(self._round_need(trainer, pl_module, data))
        sampler = _training_sampler(trainer)
        if sampler is None or engine is not sampler.engine:
            engine.setup(trainer, pl_module)  # the sampler sets its own up (with this need too, when this runs first)

    def _round_need(self, trainer: pl.Trainer, pl_module: pl.LightningModule, data: DataSide) -> RoundNeed:
        """An evaluation batch's sequences at their longest (as ``GroupSampler._round_need``)."""
        sequences = (data.eval_batch_size() or 1) * self.samples_per_prompt
        context = context_length(pl_module.policy, pl_module.tokenizer)
        budget = self.sampling_settings(pl_module).max_new_tokens
        sampler = _training_sampler(trainer)
        episodes = sampler.episodes if sampler is not None else None
        if episodes is not None:
            return RoundNeed(sequences, episodes.episode_budget(context) or budget)
        return round_need(data, pl_module.tokenizer, "eval", sequences, budget, context)

    def _engine_of(self, trainer: pl.Trainer) -> SamplingEngine:
        """Its own engine, else the training sampler's (one engine, one copy of the weights), else ``hf``."""
        if self._engine is None:
            sampler = _training_sampler(trainer)
            self._engine = sampler.engine if sampler is not None else resolve_engine("hf")
        return self._engine

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
        """Decode every held-out prompt of this rank n times, score it, reduce across ranks, log, record.

        Returns ``eval/accuracy`` (the fraction of solved samples, pass@1).
        """
        # pass@1 is eval/accuracy, so it is always estimated, logged as pass@1 or not.
        metric = PassAtK(sorted({1, *self.pass_k})).to(metric_device(pl_module.device))
        rank = getattr(trainer, "global_rank", 0)
        seed = evaluation_seed(self.seed, trainer.global_step, rank)
        engine = self._engine_of(trainer)
        sampler = _training_sampler(trainer)
        # an engine of its own may be sampling ahead: the sampler lends it for the evaluation's time
        with sampler.engine_lent() if sampler is not None else nullcontext():
            engine.before_rollout(trainer, pl_module)  # outside the inference context (see GroupSampler._new_round)
            self._episode_figures = []
            with isolated_rng(seed, pl_module.device), inference_context(trainer):
                for number, batch in enumerate(trainer.datamodule.heldout_dataloader()):
                    num_correct, counted = self._score_batch(trainer, pl_module, batch, seed + number)  # [P], [P]
                    if bool(counted.any()):
                        metric.update(num_correct[counted].to(metric.device), self.samples_per_prompt)
                engine.after_rollout()
        values = {name: float(value) for name, value in metric.compute().items()}
        accuracy = values["pass@1"]
        metrics = {"eval/accuracy": accuracy} | self._episode_means()
        if self.samples_per_prompt > 1:
            metrics |= {f"eval/pass@{k}": values[f"pass@{k}"] for k in self.pass_k}
        self.history.append((trainer.global_step, accuracy))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        return accuracy

    def _score_batch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: PromptBatch, seed: int
    ) -> tuple[Tensor, Tensor]:
        """Solved samples per prompt [P] and which prompts count [P] bool (not skipped), both on the CPU."""
        n = self.samples_per_prompt
        sampler = _training_sampler(trainer)
        scoring = Scoring([self.correct_for(trainer)], [1.0], settings=["evaluation.correct"])
        episodes = sampler.episodes if sampler is not None else None  # the held-out prompts as episodes too
        errors = sampler.reward_errors if sampler is not None else "raise"
        sharded = parameters_are_sharded(trainer)
        sampling = self.sampling_settings(pl_module)
        run = trajectory_run(self._engine, pl_module.policy, pl_module.tokenizer, sampling, episodes, errors,
                             synced_gpus=sharded, device=pl_module.device)  # fmt: skip
        any_rank = lambda wanted: trainer.strategy.reduce_boolean_decision(wanted, all=False)  # noqa: E731
        # n samples of each prompt: prompt i's are rows i*n .. i*n + n - 1
        rollout, _ = sample_and_score_trajectories(
            run, batch.prompts, batch.columns, n, scoring, seed, self.prompt_overflow, "evaluation.prompt_overflow",
            any_rank if sharded else bool,
        )  # fmt: skip
        if rollout.episodes is not None:
            self._episode_figures.append(episode_stats(rollout.episodes))
        num_correct = count_solved(rollout.rewards.cpu(), n, self.solved_at)  # [P]
        assert rollout.prompt_cut is not None
        cut = rollout.prompt_cut.view(-1, n)[:, 0].cpu()  # [P]
        return num_correct, ~cut if self.prompt_overflow == "skip" and episodes is None else torch.ones_like(cut)

    def _episode_means(self) -> dict[str, float]:
        """``eval/turns_mean`` and ``eval/tool_calls_mean`` of this rank's held-out episodes (none when single-turn)."""
        if not self._episode_figures:
            return {}
        names = ("turns_mean", "tool_calls_mean", "tool_errors_mean")
        return {f"eval/{name}": sum(float(f[name]) for f in self._episode_figures) / len(self._episode_figures)
                for name in names}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [tuple(item) for item in state_dict["history"]]


def default_correct(episodes: EpisodeSettings | None) -> Callable[..., list[float]]:
    """What scores held-out completions when ``evaluation.correct`` is unset: the environment's reward of episodes
    with an environment; for anything else a ``SettingError`` saying what to set."""
    if episodes is not None and episodes.environment is not None:
        return environment_reward
    answer = "the final answer of each episode" if episodes is not None else "each held-out completion"
    raise SettingError(
        f"evaluation.correct is not set: name the reward function that scores {answer} (a completion counts as "
        "solved when its score reaches evaluation.solved_at), e.g. evaluation.correct: {class_path: "
        "gspo_lightning.rewards.ExactAnswer}; only episodes with an environment (sampler.episodes.environment) "
        "default to their environment's reward, gspo_lightning.episodes.environment_reward"
    )


def _training_sampler(trainer: pl.Trainer) -> GroupSampler | None:
    return next((c for c in getattr(trainer, "callbacks", []) if isinstance(c, GroupSampler)), None)


def metric_device(device: torch.device) -> torch.device:
    """Where the float64 pass@k states live: the module's device (DDP reduces there), except MPS (no float64)."""
    return torch.device("cpu") if device.type == "mps" else device

def count_solved(scores: Tensor, samples_per_prompt: int, solved_at: float) -> Tensor:
    """[P] int64: how many of each prompt's n = ``samples_per_prompt`` samples scored >= ``solved_at`` (``scores``
    [P * n], prompt i's at rows i*n .. i*n + n - 1)."""
    solved = scores >= solved_at  # [P * n] bool; NaN counts as unsolved
    return solved.view(-1, samples_per_prompt).sum(-1)  # [P]
