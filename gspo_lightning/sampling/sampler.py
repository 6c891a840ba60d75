"""GroupSampler: the Lightning plumbing around one rollout round (``rollout/round.py``).

It decides when a round starts (the first of the K optimizer steps on a prompt batch), asks its round source
(``rollout/source.py``: on-policy, fixed lag or streaming, picked once from ``sampler.asynchronous``) for the
round, hands minibatch k to step k, logs the round's figures and keeps
each rank's partly consumed round and random state for an exact resume. What it needs from the LightningModule
is ``rollout/contract.py``'s ``SamplerModule``; its dataloader yields ``PromptBatch`` objects, each round served
K times in a row with ``minibatch_index`` 0..K-1 (``PromptDataModule`` does this).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from gspo_lightning.asynchronous import AsyncRollouts
from gspo_lightning.asynchronous.rounds import FixedLagRounds, StreamingRounds
from gspo_lightning.engines import EngineName, SamplingEngine, resolve_engine
from gspo_lightning.engines.base import RoundNeed
from gspo_lightning.episodes.settings import EpisodeSettings
from gspo_lightning.metric_logging import log_across_ranks, shows_progress_bar
from gspo_lightning.objectives import AdvantageScale
from gspo_lightning.rewards.isolation import RewardIsolation, RewardRunner
from gspo_lightning.rewards.scoring import RewardErrors, RewardFunction
from gspo_lightning.rollout import checks
from gspo_lightning.rollout.checks import OldLogprobSource
from gspo_lightning.rollout.data_contract import DataSide
from gspo_lightning.rollout.contract import SamplerModule, check_built, check_sampler_module, round_model
from gspo_lightning.rollout.minibatches import check_divisible
from gspo_lightning.rollout.pipeline import PromptOverflow, Scoring, context_length
from gspo_lightning.rollout.round import RoundModel, RoundSettings, sample_groups
from gspo_lightning.rollout.source import OnPolicyRounds, RoundRequest, RoundSource
from gspo_lightning.rollout.round import with_advantages
from gspo_lightning.rollout.state import evaluation_seed, rank_and_world, restore_rng_states, restored_round
from gspo_lightning.rollout.state import round_checkpoint
from gspo_lightning.rollout.stats import rollout_stats
from gspo_lightning.rollout.types import Minibatch, PromptBatch, Rollout
from gspo_lightning.strategies import parameters_are_sharded
from gspo_lightning.validation import SettingError


class GroupSampler(Callback):
    """Samples G responses per prompt, scores them, and hands the module K minibatches, one per step.

    The samples' temperature and longest response are the module's (``model.temperature``,
    ``model.max_new_tokens``): one setting each, for the samples and for every log-prob taken of them.

    Args:
        rewards: reward functions ``(prompts, completions, **columns) -> list[float]``, by import path or
            ``class_path``; their weighted sum is the reward. A reward with a ``required_columns`` attribute
            has those columns checked against the data when it is set up, before the model loads; one with a
            ``setup(tokenizer)`` method gets the policy's tokenizer at fit start.
        reward_weights: one weight per reward function (default: all 1.0).
        group_size: G, responses sampled per prompt (>= 2: advantages compare responses within a group).
        num_minibatches: K, optimizer steps per rollout batch (the paper uses 4); must divide P x G.
        top_p: must stay 1.0 (no nucleus truncation): pi_old's and pi_theta's log-probs are those of
            softmax(logits / temperature) over the whole vocabulary, which truncated samples do not come from.
            No other logits processor runs either, whatever the checkpoint's generation config says
            (repetition penalty, min_new_tokens, suppressed tokens, its own temperature / top_p / top_k).
        top_k: must stay 0 (no top-k truncation), for the same reason.
        advantage_scale: what the group-centred rewards are divided by: ``group`` std (Eq. 6), ``batch`` std
            of all rewards, or ``none`` (Dr. GRPO).
        reward_timeout_s: seconds one reward function may take on one rollout batch (null: no limit; needs
            ``reward_isolation`` thread or process). A slow reward shows in ``time/reward_s``.
        reward_isolation: how reward functions are called. ``thread``: in a daemon thread; on timeout the
            thread is abandoned (Python cannot stop it: it runs on in the background until it returns) and the
            call counts as failed. ``process``: in a reused worker process (spawn); on a timeout or a crash
            (segfault, os._exit) the worker is killed and replaced, so user code can neither kill nor stall
            the trainer; functions and columns must be picklable (module-level, not lambdas). ``none``: a
            direct call, no timeout possible (set ``reward_timeout_s: null``). Use ``process`` or ``none`` for
            reward code that needs the main thread (e.g. ``signal``-based time limits).
        reward_errors: what a reward function that raises, times out, kills its worker, returns the wrong
            number of values, or a NaN/inf/non-number does. ``raise``: stop with an error naming the function,
            the problem and the first offending sample. ``skip``: drop the affected samples from the learning
            signal (a failed call affects the whole batch, a bad value its own sample): every group holding
            an affected sample gets advantages 0 for all its responses (nothing is imputed), affected rewards
            are NaN and left out of the reward statistics, a warning is logged, and the samples and groups are
            counted in ``rollout/reward_errors`` and ``rollout/groups_skipped``.
        prompt_overflow: what a prompt does when its tokens plus ``max_new_tokens`` exceed the policy's
            context (``config.max_position_embeddings``, else the tokenizer's ``model_max_length``). ``error``:
            stop before generating, naming the prompt. ``truncate``: keep its last (context - max_new_tokens)
            tokens (left truncation keeps the end of the question; a system prompt or few-shot examples at the
            start are lost), counted in ``rollout/prompts_truncated``. ``skip``: truncated the same way for
            generation (shapes stay fixed), but its group gets advantages 0 (no learning signal), counted in
            ``rollout/prompts_skipped``.
        engine: what samples the responses (and the held-out evaluation's): ``hf`` (Hugging Face ``generate`` on
            the trained policy, the default and the CPU path), ``vllm`` (a colocated vLLM engine that receives
            the trainer's weights before every round), or ``{class_path: ..., init_args: {...}}`` for either's
            options (``gspo_lightning.engines.HFEngine``, ``gspo_lightning.engines.VLLMEngine``) or your own
            ``SamplingEngine``.
        old_logprobs: where pi_old's log-probs come from. ``recompute`` (default): a trainer forward over the
            sampled sequences right after sampling, in the precision context of ``training_step`` (ratio exactly
            1 on a round's first minibatch). ``engine``: the log-probs the engine computed while sampling, used
            directly (no second forward); its rollout-training mismatch then shows as ratios != 1 on a round's
            first minibatch (GSPO section 5.4). Routing Replay needs ``recompute``.
        dynamic_sampling: DAPO's dynamic sampling: drop the groups whose G rewards are all equal (advantages 0, no
            learning signal) and sample more prompts (``PromptDataModule.draw_prompts``, a second stream over the
            training split) until the round holds P informative groups again, at most ``max_extra_draws`` more
            batches of P prompts; short of P after that, the round trains on what there is, padded with dropped
            groups (they add nothing). Counted in ``rollout/groups_drawn``, ``groups_dropped``, ``groups_kept`` and
            ``extra_draws``.
        max_extra_draws: the cap on extra prompt batches per round (>= 0).
        mask_truncated: leave responses cut at ``max_new_tokens`` without EOS out of the loss (DAPO's overlong
            filtering); their rewards still count in their group's advantages. Counted in
            ``rollout/truncated_masked``. With episodes: those that hit any of their limits.
        episodes: multi-turn episodes instead of single responses: ``{tools: [...]}`` (the tool-calling loop) or
            ``{environment: {class_path: ...}}``, with their limits (see ``gspo_lightning.episodes.EpisodeSettings``).
            The reward functions score each episode's final answer; only the policy's own tokens are trained.
        asynchronous: sampling ahead of training: ``{mode: fixed_lag, lag: 1}`` samples round r + lag while round
            r trains, with the weights of round r's start (see ``gspo_lightning.asynchronous.AsyncRollouts``). With
            an engine of its own (``engine: vllm_process``) the two overlap; with ``hf`` or the colocated ``vllm``
            the schedule is the same but each round still waits for its sampling (they share the trainer's
            device). ``{mode: streaming, max_staleness: 2}`` (``vllm_process`` only): generation never waits, new
            weights are loaded between chunks, and no trained token is more than ``max_staleness`` versions old.
            Needs ``old_logprobs: recompute`` (pi_old becomes the proximal policy); pair it with
            ``model.rollout_correction`` for the behaviour-to-proximal gap.
    """

    def __init__(
        self,
        rewards: Sequence[Callable[..., list[float]]],
        reward_weights: Sequence[float] | None = None,
        group_size: int = 8,
        num_minibatches: int = 4,
        top_p: float = 1.0,
        top_k: int = 0,
        advantage_scale: AdvantageScale = "group",
        reward_timeout_s: float | None = 60.0,
        reward_isolation: RewardIsolation = "thread",
        reward_errors: RewardErrors = "raise",
        prompt_overflow: PromptOverflow = "error",
        engine: SamplingEngine | EngineName = "hf",
        old_logprobs: OldLogprobSource = "recompute",
        dynamic_sampling: bool = False,
        max_extra_draws: int = 4,
        mask_truncated: bool = False,
        episodes: EpisodeSettings | None = None,
        asynchronous: AsyncRollouts | None = None,
    ) -> None:
        checks.validate_old_logprobs(old_logprobs)
        self.engine = resolve_engine(engine)
        self.asynchronous = asynchronous or AsyncRollouts()
        checks.validate_asynchronous(self.asynchronous, old_logprobs, dynamic_sampling, self.engine)
        checks.validate_sampling(rewards, reward_weights, group_size, num_minibatches, top_p, top_k)
        checks.validate_round(advantage_scale, max_extra_draws)
        checks.validate_robustness(reward_timeout_s, reward_isolation, reward_errors, prompt_overflow)
        self.rewards: list[RewardFunction] = list(rewards)
        self.reward_runner = RewardRunner(reward_isolation, reward_timeout_s)
        self.old_logprobs = old_logprobs
        weights = list(reward_weights) if reward_weights is not None else [1.0] * len(self.rewards)
        self.round = RoundSettings(
            group_size, num_minibatches, Scoring(self.rewards, weights, self.reward_runner, reward_errors), top_p,
            top_k, advantage_scale, old_from_engine=old_logprobs == "engine", prompt_overflow=prompt_overflow,
            dynamic_sampling=dynamic_sampling, max_extra_draws=max_extra_draws, mask_truncated=mask_truncated,
            episodes=episodes,
        )  # fmt: skip
        checks.validate_episodes(episodes, prompt_overflow, self.engine)
        self.last_rollout: Rollout | None = None
        """This rank's latest round as trained on (texts, rewards, final advantages), e.g. for ``LogCompletions``;
        None until a round was sampled in this process."""
        self._rollout_index: int | None = None
        self._minibatches: list[Minibatch] = []
        self._stats: dict[str, torch.Tensor] = {}
        self._pending_rng: dict[str, Any] | None = None
        self._round_seconds: dict[str, float] = {}
        self._engine_figures: dict[str, float] = {}
        self._step_started = 0.0
        self.source = round_source(self.asynchronous, self.engine)
        """Where each round's samples come from (``rollout/source.py``); the only place the mode is looked at."""

    @property
    def group_size(self) -> int:
        return self.round.group_size

    @property
    def num_minibatches(self) -> int:
        return self.round.num_minibatches

    @property
    def episodes(self) -> EpisodeSettings | None:
        """``sampler.episodes`` (None: single responses); the held-out evaluation samples its prompts alike."""
        return self.round.episodes

    @property
    def reward_errors(self) -> str:
        """``sampler.reward_errors``: what a failed reward, tool or environment does (also in the evaluation)."""
        return self.round.scoring.errors

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Checks that need no model: Lightning calls this before ``configure_model`` builds the policy."""
        if stage != "fit":
            return
        module = check_sampler_module(pl_module)
        data = DataSide(trainer.datamodule)
        checks.check_rollout_shape(data, self.group_size, self.num_minibatches)
        checks.check_chat_template(data, module.tokenizer, module.policy_loader)
        checks.check_routing_replay(module.routing_replay, self.old_logprobs, self.engine, trainer.strategy.root_device)
        checks.check_rollout_correction(module.rollout_correction.mode, self.old_logprobs)
        checks.check_data_columns(data, self.rewards, "train", "sampler.rewards")
        if self.round.dynamic_sampling:
            data.needs("draw_prompts", "sampler.dynamic_sampling (it refills a round with more prompts)")
        checks.check_turn_advantages(self.round.episodes, module.per_token_advantages)
        checks.check_asynchronous(data, module.rollout_correction.mode, self.asynchronous)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        module = check_sampler_module(pl_module)
        check_built(module)
        loader = module.policy_loader
        data = DataSide(trainer.datamodule)
        checks.check_chat_template(data, module.tokenizer, loader)  # a tokenizer built in configure_model
        context = context_length(module.policy, module.tokenizer)
        if self.round.episodes is not None:
            checks.check_episode_tokenizer(module.tokenizer, loader)
            self.round.episodes.episode_budget(context)  # within the context
        elif self.round.prompt_overflow == "error":
            checks.check_prompt_lengths(data, module.tokenizer, context, module.max_new_tokens)
        if self.round.episodes is None:  # an episode's length is its turns': checked as each minibatch is cut
            budget = module.batch_layout.micro_batch_tokens
            checks.check_micro_batch_budget(data, module.tokenizer, budget, module.max_new_tokens, context)
        for reward in self.rewards:  # e.g. LengthPenalty counts the policy's tokens
            if callable(getattr(reward, "setup", None)):
                reward.setup(module.tokenizer)
        self.engine.reserve(self._round_need(data, module.tokenizer, context, module.max_new_tokens))
        self.engine.setup(trainer, pl_module)
        checks.check_routing_replay(module.routing_replay, self.old_logprobs, self.engine, module.device, set_up=True)

    def _round_need(self, data: DataSide, tokenizer: Any, context: int | None, max_new_tokens: int) -> RoundNeed:
        """A round's P x G sequences at their longest: prompt with ``max_new_tokens``, or an episode's budget."""
        sequences = (data.prompts_per_rollout() or 1) * self.group_size
        if self.round.episodes is not None:
            budget = self.round.episodes.episode_budget(context)
            return RoundNeed(sequences, budget or max_new_tokens)
        return checks.round_need(data, tokenizer, "train", sequences, max_new_tokens, context)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.source.close()  # before the engine: a background job may be using it
        self.reward_runner.close()
        self.engine.teardown()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips ``teardown`` when a run fails; an engine left to shut down at exit would bury the error
        self.teardown(trainer, pl_module, "fit")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: PromptBatch, batch_idx: int
    ) -> None:
        if batch.num_minibatches != self.num_minibatches:
            raise SettingError(
                f"the dataloader serves each rollout batch {batch.num_minibatches} times but the sampler's "
                f"num_minibatches is {self.num_minibatches}: they must be equal (the CLI links them)"
            )
        if self._pending_rng is not None:
            # Restored here, not in load_state_dict: Lightning draws from the global RNG between loading a
            # checkpoint and the first step (the dataloader iterator's base seed), which the original run did not.
            restore_rng_states(self._pending_rng)
            self._pending_rng = None
        self._round_seconds = {}
        if batch.rollout_index != self._rollout_index or not self._minibatches:
            self._new_round(trainer, pl_module, batch)
        batch.minibatch = self._minibatches[batch.minibatch_index].to(pl_module.device)
        seconds = dict.fromkeys(("generate_s", "reward_s", "old_logprob_s", *self.source.seconds_logged), 0.0)
        seconds |= self._round_seconds
        metrics = {f"rollout/{k}": v for k, v in self._stats.items()} | {f"time/{k}": v for k, v in seconds.items()}
        metrics |= {f"engine/{k}": float(v) for k, v in self._engine_figures.items()}
        self._engine_figures = {}  # once per round: they count what happened since the last
        log_across_ranks(pl_module, metrics, len(batch.minibatch))
        if shows_progress_bar(pl_module):
            pl_module.log("reward", self._stats["reward_mean"], prog_bar=True, logger=False, batch_size=1)
        self._step_started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        log_across_ranks(pl_module, {"time/train_s": time.perf_counter() - self._step_started})

    def _new_round(self, trainer: pl.Trainer, pl_module: SamplerModule, batch: PromptBatch) -> None:
        check_divisible(len(batch) * self.group_size, self.num_minibatches)
        sourced = self.source.next_round(self._request(trainer, pl_module, batch))
        result = sourced.result
        self.last_rollout = result.rollout
        self._minibatches = result.minibatches
        self._round_seconds = result.seconds | sourced.seconds
        self._engine_figures = self.engine.take_figures()
        self._stats = rollout_stats(result.rollout, self.group_size) | sourced.stats
        self._stats.update({name: torch.tensor(float(value)) for name, value in result.counts.items()})
        if self.round.mask_truncated:
            self._stats["truncated_masked"] = result.rollout.truncated.float().sum().cpu()
        self._rollout_index = batch.rollout_index

    def _request(self, trainer: pl.Trainer, pl_module: SamplerModule, batch: PromptBatch) -> RoundRequest:
        # An engine of its own samples while the policy trains: it needs no synced_gpus (it never runs the policy)
        sharded = parameters_are_sharded(trainer) and not self.source.runs_in_background
        engine_logprobs = self._wants_engine_logprobs()
        routes = self.engine.records_routes  # every MoE round records them: R3, or the diagnostic without it
        data = trainer.datamodule
        return RoundRequest(
            trainer, batch.rollout_index, batch, lambda: round_model(pl_module, engine_logprobs, sharded, routes),
            self.round,
            prompts_of=lambda index: data.rollout_batch(index),  # sources that sample ahead (checked at setup)
            seed_of=self.round_seed, draw_prompts=data.draw_prompts if self.round.dynamic_sampling else None,
            any_rank=lambda wanted: trainer.strategy.reduce_boolean_decision(wanted, all=False),
        )  # fmt: skip

    @contextmanager
    def engine_lent(self) -> Iterator[None]:
        """The engine used from this thread for a while (the evaluation): sampling in flight finishes first, and a
        streaming loop waits until the engine is given back (then loads its own weights again)."""
        with self.source.lend():
            yield

    def sample(
        self, model: SamplerModule | RoundModel, prompts: list[Any], columns: dict[str, list[Any]], seed: int = 0
    ) -> Rollout:
        """G responses per prompt, scored, with their group advantages (Eq. 6): a round's first stages alone, for
        tests and notebooks (no refill, no old-policy pass, no reward shaping)."""
        if not isinstance(model, RoundModel):
            model = round_model(check_sampler_module(model), self._wants_engine_logprobs(), False,
                                self.engine.records_routes)  # fmt: skip
        rollout = sample_groups(self.engine, model, self.round, prompts, columns, seed)
        return with_advantages(rollout, rollout.rewards, self.round)

    def _wants_engine_logprobs(self) -> bool:
        """pi_old from the engine, or an engine that reports them for free (then the mismatch is measured); a
        module whose loss corrects for the mismatch asks too (``round_model``); sampled ahead, the behaviour policy's
        log-probs are always wanted."""
        return self.old_logprobs == "engine" or self.engine.reports_logprobs_cheaply or self.asynchronous.enabled

    def round_seed(self, rollout_index: int) -> int:
        """The seed of one sampling round: a function of the engine's seed, the round and the rank only, so that a
        run (and a resumed run) redraws the same samples with an engine that has its own random streams."""
        rank, _ = rank_and_world()
        return evaluation_seed(self.engine.seed, rollout_index, rank)

    def state_dict(self) -> dict[str, Any]:
        """Each rank's partly consumed round and random generators travel with the checkpoint, so a resumed
        run trains on the same data and draws the same samples as an uninterrupted one."""
        ahead = self.source.state_dict()
        return round_checkpoint(self._rollout_index, self._minibatches, self._stats, self._fixed_settings(), ahead)

    def _fixed_settings(self) -> dict[str, Any]:
        """What a resumed run cannot change: the saved round, its advantages and the data position depend on it."""
        return {
            "sampler.group_size": self.group_size,
            "sampler.num_minibatches": self.num_minibatches,
            # the rounds sampled ahead (saved with the checkpoint) were drawn under these
            "sampler.asynchronous.mode": self.asynchronous.mode,
            self.asynchronous.bound_setting: self.asynchronous.rounds_ahead,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        local = restored_round(state_dict, self._fixed_settings(), "GroupSampler")
        self._rollout_index = local["rollout_index"]
        self._minibatches = [Minibatch(**fields) for fields in local["minibatches"]]
        self._stats = local["stats"]
        self._pending_rng = local["rng"]
        self.source.load_state_dict(local.get("sampled_ahead"))


def round_source(settings: AsyncRollouts, engine: SamplingEngine) -> RoundSource:
    """The round source of ``sampler.asynchronous.mode``."""
    if settings.mode == "streaming":
        return StreamingRounds(settings, engine)
    if settings.mode == "fixed_lag":
        return FixedLagRounds(settings, engine)
    return OnPolicyRounds(engine)
