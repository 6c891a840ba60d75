"""GSPOModule: the policy, its tokenizer and the chosen objective in ``training_step``.

One Lightning training step is one optimizer step on one minibatch of the current rollout batch; the sampler
callback fills ``batch.minibatch`` before the step. No second copy of the weights is kept for pi_old: the old
policy's per-token log-probs travel in the minibatch (see ``rollout/minibatches.py``). A frozen reference
policy exists only when the objective has a KL penalty (``kl_coef > 0``).
"""

from __future__ import annotations

import copy
import warnings
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from gspo_lightning.logprobs import DEFAULT_CHUNK_SIZE, TokenScores, check_packing
from gspo_lightning.logprobs import response_scores
from gspo_lightning.micro_batches import BatchLayout
from gspo_lightning.metric_logging import StepMetrics, attached_trainer, log_across_ranks
from gspo_lightning.models import PolicyLoader
from gspo_lightning.moe.routing import NOT_RECORDED, RoutingReplay, capture_routes, expert_change_fraction
from gspo_lightning.moe.routing import find_routers, replay_routes, routing_replay_mode
from gspo_lightning.objectives import (
    KLRewardPenalty,
    ObjectiveSpec,
    RolloutCorrection,
    correct_rollout,
    objective_gradient,
    objective_loss,
    resolve_objective,
    reward_kl_penalty,
)
from gspo_lightning.resume import apply_configured_settings, check_fixed_settings, optimizer_settings
from gspo_lightning.rollout.data_contract import DataSide
from gspo_lightning.rollout.types import Minibatch, PromptBatch
from gspo_lightning.step_metrics import log_expert_change, log_mismatch, log_rollout_route_change, log_step_metrics
from gspo_lightning.strategies import hands_over_hf_checkpointing, is_fsdp1, refuse_micro_batches_sharded
from gspo_lightning.strategies import inference_context, shard_for_strategy
from gspo_lightning.validation import SettingError, check_optimizer_settings, require

# The policy stays in eval mode on purpose (see configure_model); Lightning's notice about it is noise here.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")

class GSPOModule(pl.LightningModule):
    """Trains a Hugging Face causal LM with GSPO (Eqs. 5, 7) or a relative (GSPO-token, GRPO, DAPO, Dr. GRPO).

    Args:
        policy: how to build the policy and its tokenizer: a loader of ``gspo_lightning.models`` (``Pretrained``,
            ``TinyQwen3``, ``TinyQwen3Moe``, ``LoRA``), a task's warm-started tiny policy of
            ``gspo_lightning.data`` (``WarmStartedTinyQwen3`` and its Countdown, scratchpad and calculator
            siblings), or your own ``PolicyLoader``.
        objective: a registered objective's name (``gspo``, ``gspo_token``, ``grpo``, ``dapo``, ``dr_grpo``,
            ``cispo``, ``gmpo``, ``sapo``; see ``gspo_lightning.objectives.OBJECTIVES``) or a spec
            ``{name, kl_coef, kl_estimator, kl_in, options}`` (see ``ObjectiveSpec``).
        eps_low: lower clipping range, the ratio clipped at 1 - eps_low (default: the objective's, the paper's
            value where a paper gives one: 3e-4 for GSPO, 0.2 for GRPO).
        eps_high: upper clipping range, the ratio clipped at 1 + eps_high (default: the objective's: 4e-4 GSPO,
            0.27 GRPO, 0.28 DAPO).
        optimizer: the optimizer over the trainable parameters (default AdamW, lr 1e-6, no weight decay); from the
            command line ``--optimizer`` (any ``torch.optim`` class, or e.g. ``bitsandbytes.optim.AdamW8bit``). A
            resumed run takes the configured settings (learning rate, betas, ...), the schedule's position kept.
        lr_scheduler: a learning-rate schedule stepped every optimizer step (default: none, a constant rate); from
            the command line ``--lr_scheduler`` (``gspo_lightning.schedules.LinearWarmup``, ``CosineWithWarmup``,
            or any ``torch.optim.lr_scheduler`` class).
        temperature: the sampling temperature (> 0), which the sampler reads, and so the temperature of every
            log-prob: pi_old and pi_theta describe the distribution the responses were drawn from.
        reference_on_cpu: keep the KL reference policy (only built when kl_coef > 0) on the CPU.
        log_entropy: log the policy's mean token entropy on the response tokens (one extra softmax).
        logprob_chunk_size: response tokens per chunk of the LM head when computing log-probs, so the
            [n, R, V] float32 logits never exist; 0 materialises them (the naive path, more memory). pi_old's
            log-probs are computed the same way.
        max_new_tokens: longest response (>= 1), which the sampler reads (longer ones are cut and counted as
            truncated; the held-out evaluation's default too): Dr. GRPO's constant normaliser when the
            objective leaves ``max_tokens`` unset, and the length buckets of the clip diagnostics.
        activation_checkpointing: recompute each decoder layer's activations in backward instead of keeping them
            (less memory, about one more forward of compute), on every strategy (single device, DDP, FSDP1 through
            ``DecoderLayerFSDP``, FSDP2). The policy stays in eval mode (dropout off): a policy whose loader
            enabled Hugging Face's gradient checkpointing, which does nothing in eval mode, gets this instead.
        packing: run pi_old's, the reference's and pi_theta's forwards over each minibatch's sequences packed end
            to end (``gspo_lightning.packing``) instead of the padded [n, prompt + response] rectangle, and the LM
            head over the response tokens only: the same log-probs and gradients (to float rounding) for less
            compute where lengths differ. Needs a model whose attention honours restarting position ids
            (Hugging Face's sdpa, eager and flash attention do; checked when the fit starts). Mixture-of-experts
            policies record and replay their experts per sequence token, whatever the layout.
        micro_batch_tokens: at most this many tokens per forward (real tokens with packing, rows x the padded
            width without): each minibatch's passes run micro-batch by micro-batch, balanced by tokens, so memory
            follows this budget, not the longest response. The loss is still the whole minibatch's (the same
            update); pi_theta's forward is recomputed in backward for all micro-batches but the last (about one
            more forward). None (default): one forward per minibatch. Not with FSDP yet.
        rollout_correction: how training corrects for the sampling engine's distribution differing from the
            trainer's pi_old (``{mode: off | tis | mis | token_mask, threshold: C}``; see
            ``gspo_lightning.objectives.rollout_correction``). Needs ``sampler.old_logprobs: recompute``.
        routing_replay: mixture-of-experts policies only, one of ``off``, ``old``, ``rollout``. ``old`` (R2,
            GSPO section 4.3): force the experts pi_old's forward activated for each token in pi_theta's forward,
            the router still receiving gradient through the forced experts' weights (needs
            ``sampler.old_logprobs: recompute``). ``rollout`` (R3): force the experts the sampling engine chose
            in the pi_old, reference and pi_theta forwards (an engine that records them: ``hf``). Whatever the
            choice, ``moe/expert_change_frac`` reports how far pi_theta's routing moved from pi_old's and, when the
            engine records experts, ``moe/rollout_vs_old_change_frac`` how far pi_old's is from the sampler's.
    """

    def __init__(
        self,
        policy: PolicyLoader,
        objective: str | ObjectiveSpec = "gspo",
        eps_low: float | None = None,
        eps_high: float | None = None,
        optimizer: OptimizerCallable = lambda params: torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0),
        lr_scheduler: LRSchedulerCallable | None = None,
        temperature: float = 1.0,
        reference_on_cpu: bool = False,
        log_entropy: bool = True,
        max_new_tokens: int = 256,
        routing_replay: RoutingReplay | bool = "off",
        logprob_chunk_size: int = DEFAULT_CHUNK_SIZE,
        activation_checkpointing: bool = False,
        rollout_correction: RolloutCorrection = RolloutCorrection(),
        packing: bool = False,
        micro_batch_tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.objective = _with_token_budget(_resolve(objective), max_new_tokens)
        default_low, default_high = self.objective.objective.clip_range
        self.eps_low = default_low if eps_low is None else eps_low
        self.eps_high = default_high if eps_high is None else eps_high
        self.objective.objective.check_clip_range(self.eps_low, self.eps_high)
        # The chunked LM head predicts the objective's gradient only for a sum of per-response terms.
        self._predictable = self.objective.objective.separable
        if not self._predictable:
            rank_zero_warn(
                f"objective {self.objective.name!r} is not a sum of per-response terms: the chunked LM head "
                "recomputes its gradients in backward (one more matmul per chunk)"
            )
        require(temperature > 0, f"model.temperature must be > 0, got {temperature}")
        require(max_new_tokens >= 1, f"model.max_new_tokens must be >= 1, got {max_new_tokens}")
        require(
            logprob_chunk_size >= 0, f"model.logprob_chunk_size must be >= 0 (0: no chunking), got {logprob_chunk_size}"
        )
        require(
            micro_batch_tokens is None or micro_batch_tokens > max_new_tokens,
            f"model.micro_batch_tokens must be null or > model.max_new_tokens ({max_new_tokens}): a sequence is a "
            f"prompt and up to max_new_tokens response tokens, never split; got {micro_batch_tokens}",
        )
        check_optimizer_settings(optimizer, lr_scheduler)  # now, not after the policy has loaded
        self._routing_replay = routing_replay_mode(routing_replay)
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])  # functions; the CLI's config has them
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.step_metrics = StepMetrics()  # every producer's figures of a step, written once at its end
        self._logged_step = 0
        self.policy_loader = policy
        self.rollout_correction = (
            RolloutCorrection(**rollout_correction) if isinstance(rollout_correction, dict) else rollout_correction
        )
        self.tokenizer = policy.load_tokenizer()
        self.policy: nn.Module | None = None
        # A plain list keeps the reference out of state_dict, the optimizer and Lightning's device moves:
        # it is the frozen initial policy, rebuilt from the loader on resume, and may stay on the CPU.
        self._reference: list[nn.Module] = []
        self._replay = ExitStack()  # open from a replayed forward until after its backward
        self._skip_update = False
        self._configured: list[list[dict[str, Any]]] = []  # the optimizers' settings as configured, for resume

    @property
    def reference_policy(self) -> nn.Module | None:
        """The frozen initial policy for the KL penalty, or None when the objective has none."""
        return self._reference[0] if self._reference else None

    @property
    def kl_reward_penalty(self) -> KLRewardPenalty | None:
        """The KL penalty the sampler subtracts from the rewards (objective ``kl_in: reward``), or None."""
        return reward_kl_penalty(self.objective)

    def setup(self, stage: str) -> None:
        """Before ``configure_model`` builds (and a warm-start loader trains) the policy: the warm start's task
        settings must be the data's."""
        data = DataSide(getattr(attached_trainer(self), "datamodule", None))
        check = getattr(self.policy_loader, "check_matches", None)
        if stage == "fit" and callable(check) and data.offers("source"):
            check(data.datamodule.source, data.template())

    def configure_model(self) -> None:
        """Build the policy here, not in ``__init__``, so sharded strategies can wrap it as it is created."""
        if self.policy is not None:
            return
        # Eval mode for good: dropout off, so pi_old and pi_theta are the same deterministic function of the
        # weights and the first minibatch of every round is exactly on-policy (ratio 1).
        self.policy = self.policy_loader.load_model(self.tokenizer).eval()
        checkpointing = self.hparams.activation_checkpointing or hands_over_hf_checkpointing(self.policy)
        if self.objective.kl_coef > 0:  # copied before sharding: every rank holds the whole frozen reference
            self._reference = [copy.deepcopy(self.policy).requires_grad_(False).eval()]
        if self._routing_replay != "off" and not find_routers(self.policy):
            raise SettingError(
                f"model.routing_replay: {self._routing_replay} needs a mixture-of-experts policy, but "
                f"{type(self.policy).__name__} has no top-k router; set routing_replay: 'off'"
            )
        # FSDP2 shards here; FSDP1 wraps afterwards; DDP and a single device replicate
        trainer = attached_trainer(self)
        strategy = trainer.strategy if trainer is not None else None
        refuse_micro_batches_sharded(self.hparams.micro_batch_tokens, strategy)
        shard_for_strategy(self.policy, strategy, self.device_mesh, checkpointing)

    def on_fit_start(self) -> None:
        self.policy.eval()
        if self.hparams.packing:
            trainer = attached_trainer(self)
            with inference_context(trainer) if trainer is not None else torch.no_grad():  # FSDP1: the root gathered
                check_packing(self.policy)
        if self.reference_policy is not None:
            # In the policy's precision: the precision plugin converts this module (bf16-true: its weights to
            # bfloat16) but not the reference, which lives outside it; mixed precision leaves both in float32.
            device = "cpu" if self.hparams.reference_on_cpu else self.device
            self.reference_policy.to(device=device, dtype=self.dtype)

    def training_step(self, batch: PromptBatch, batch_idx: int) -> Tensor:
        minibatch = batch.minibatch
        if minibatch is None:
            raise RuntimeError("training_step got no minibatch: add gspo_lightning.GroupSampler to the callbacks")
        terms, correction_stats = self._objective_terms(minibatch)  # the same for the loss and its gradient
        scores, expert_change = self._policy_scores(minibatch, terms)  # [n, R] each, [layers] or None
        logprobs = scores.logprobs  # [n, R]
        loss, stats = objective_loss(self.objective, logprobs, *terms)
        finite = bool(torch.isfinite(loss))
        self._skip_update = not self._on_every_rank(finite)
        if self._skip_update:
            # Every rank still runs backward (its collectives must match the others'); the gradients are then
            # dropped on all of them in on_before_optimizer_step, so the replicas stay equal.
            rank_zero_warn(f"step {self.global_step}: a non-finite loss on some rank: the update is skipped on all")
        # Logged by every rank, so that every rank queues the same figures; summed: the ranks that had one.
        log_across_ranks(self, {"faults/nonfinite_loss": float(not finite)}, len(minibatch))
        if scores.entropy is not None:
            stats["entropy"] = _mean_entropy(scores.entropy, minibatch)
        log_step_metrics(self, loss, stats, logprobs.detach(), minibatch, batch.minibatch_index)
        if minibatch.engine_logprobs is not None:  # pi_old recomputed, the engine's log-probs at hand
            log_mismatch(self, minibatch, correction_stats)
        if expert_change is not None:
            log_expert_change(self, expert_change, len(minibatch), batch.minibatch_index)
        if minibatch.rollout_route_change is not None:
            log_rollout_route_change(self, minibatch.rollout_route_change, len(minibatch))
        return loss

    @property
    def temperature(self) -> float:
        """The temperature of every log-prob this module computes: the sampler's (checked at fit start)."""
        return self.hparams.temperature

    @property
    def max_new_tokens(self) -> int:
        """The sampler's response budget (checked at fit start): Dr. GRPO's constant and the length buckets."""
        return self.hparams.max_new_tokens

    @property
    def routing_replay(self) -> str:
        """``model.routing_replay``: ``off``, ``old`` (pi_old's experts) or ``rollout`` (the sampler's)."""
        return self._routing_replay

    @property
    def skips_update(self) -> bool:
        """Whether this step's update is dropped on every rank (some rank's loss was NaN/inf)."""
        return self._skip_update

    def _on_every_rank(self, finite: bool) -> bool:
        """One decision for all ranks: a rank that skipped alone would desynchronise the collectives (a hang)."""
        trainer = attached_trainer(self)
        return finite if trainer is None else trainer.strategy.reduce_boolean_decision(finite, all=True)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._skip_update:  # AdamW leaves a parameter without gradient (and its state) untouched
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    parameter.grad = None

    @property
    def logprob_chunk_size(self) -> int:
        """LM-head chunk size of every log-prob computation of this policy (the sampler's pi_old too)."""
        return self.hparams.logprob_chunk_size

    @property
    def batch_layout(self) -> BatchLayout:
        """How every log-prob pass of this policy (the sampler's pi_old too) lays out a minibatch: packed or not,
        by token budget or whole."""
        return BatchLayout(self.hparams.packing, self.hparams.micro_batch_tokens)

    def _response_scores(self, minibatch: Minibatch, terms: tuple[Any, ...]) -> TokenScores:
        length = minibatch.response_ids.shape[1]
        return response_scores(
            self.policy,
            minibatch.input_ids,
            minibatch.attention_mask,
            length,
            self.hparams.temperature,
            self.logprob_chunk_size,
            with_entropy=self.hparams.log_entropy,
            predict_upstream=objective_gradient(self.objective, *terms) if self._predictable else None,
            layout=self.batch_layout,
        )

    def _objective_terms(self, minibatch: Minibatch) -> tuple[tuple[Any, ...], dict[str, Tensor]]:
        """What the objective takes besides pi_theta's log-probs: pi_old's, the advantages and the response mask
        (after the rollout correction, when one is on), the clip range and the reference's log-probs; and the
        correction's stats (empty when there is nothing to correct with)."""
        correction = self.rollout_correction
        if correction.mode != "off" and minibatch.engine_logprobs is None:
            raise RuntimeError(
                f"model.rollout_correction.mode={correction.mode!r} needs the engine's log-probs in the minibatch "
                "(GroupSampler records them with sampler.old_logprobs: recompute)"
            )
        advantages, mask, stats = minibatch.advantages, minibatch.response_mask, {}
        if minibatch.engine_logprobs is not None:
            corrected = correct_rollout(
                correction, minibatch.old_logprobs, minibatch.engine_logprobs, advantages, mask, self._sequence_level
            )
            advantages, mask, stats = corrected.advantages, corrected.mask, corrected.stats
        return (minibatch.old_logprobs, advantages, mask, self.eps_low, self.eps_high, minibatch.ref_logprobs), stats

    @property
    def _sequence_level(self) -> bool:
        """One ratio per response (GSPO, GMPO): a rollout correction then weighs responses, not tokens."""
        return self.objective.ratio == "sequence"

    @property
    def per_token_advantages(self) -> bool:
        """Whether the objective takes one advantage per token (per-turn advantages of episodes need it)."""
        return self.objective.objective.per_token_advantages

    @property
    def needs_engine_logprobs(self) -> bool:
        """Whether the sampler must record the engine's log-probs (a rollout correction is on)."""
        return self.rollout_correction.mode != "off"

    def _policy_scores(self, minibatch: Minibatch, terms: tuple[Any, ...]) -> tuple[TokenScores, Tensor | None]:
        """pi_theta's response log-probs, with pi_old's experts forced under Routing Replay; for MoE policies
        also the per-layer fraction of experts pi_theta's routers choose that pi_old's did not."""
        replay = self._routing_replay != "off"
        if minibatch.old_routes is None:
            if replay:  # GroupSampler refuses this at setup; another sampler may not
                raise RuntimeError(
                    f"model.routing_replay: {self._routing_replay} but the minibatch carries no recorded experts: "
                    "pi_old's forward records them (sampler.old_logprobs: recompute), the sampling engine under "
                    "rollout (sampler.engine: hf)"
                )
            return self._response_scores(minibatch, terms), None
        if replay:
            # Kept open until after backward: activation checkpointing re-runs the forward there.
            routes = self._replay.enter_context(replay_routes(self.policy, minibatch.old_routes))
        else:
            routes = self._replay.enter_context(capture_routes(self.policy, tuple(minibatch.input_ids.shape)))
        scores = self._response_scores(minibatch, terms)
        current = routes.stacked()  # [n, layers, L, k]
        if not replay:
            self._replay.close()
        recorded = (minibatch.old_routes[:, 0, :, 0] != NOT_RECORDED).to(minibatch.attention_mask.dtype)  # [n, L]
        return scores, expert_change_fraction(minibatch.old_routes, current, minibatch.attention_mask * recorded)

    def on_after_backward(self) -> None:
        # Forced routing ends with the backward pass (which re-runs checkpointed forwards), before any callback
        # samples or evaluates with the policy.
        self._replay.close()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._logged_step = self.global_step  # the step Lightning's own logging files this batch under

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._replay.close()
        trainer = attached_trainer(self)
        if trainer is not None:  # after every callback's on_train_batch_end: all of the step's figures are in
            self.step_metrics.write(trainer, self._logged_step)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a resume that changes a fixed setting (the saved round depends on it)."""
        check_fixed_settings(checkpoint.get("hyper_parameters", {}), self.hparams)

    def on_train_start(self) -> None:
        # Lightning restored a resumed run's optimizers with the checkpoint's settings: the configured ones apply.
        apply_configured_settings(self.trainer, self._configured)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        # FSDP1's precision plugin refuses norm clipping: the wrapped root computes the norm across shards.
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm") and is_fsdp1(self.trainer.strategy):
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> dict:
        # Only what trains: frozen weights (the base under LoRA) get no optimizer state and no weight decay.
        trainable = [parameter for parameter in self.policy.parameters() if parameter.requires_grad]
        if not trainable:
            raise SettingError("model.policy has no parameter that requires grad: nothing to train")
        optimizer = self.optimizer_factory(trainable)
        configured: dict[str, Any] = {"optimizer": optimizer}
        if self.lr_scheduler_factory is not None:
            configured["lr_scheduler"] = {"scheduler": self.lr_scheduler_factory(optimizer), "interval": "step"}
        self._configured = [optimizer_settings(optimizer)]
        return configured


def _mean_entropy(entropy: Tensor, minibatch: Minibatch) -> Tensor:
    mask = minibatch.response_mask.bool()  # [n, R]
    return torch.where(mask, entropy, torch.zeros_like(entropy)).sum() / mask.sum().clamp(min=1)


def _with_token_budget(spec: ObjectiveSpec, max_new_tokens: int) -> ObjectiveSpec:
    """Dr. GRPO's constant normaliser defaults to the generation budget, not each minibatch's longest response,
    so that a response's weight does not depend on what it is batched with."""
    if "max_tokens" in spec.objective.options and spec.resolved_options["max_tokens"] is None:
        return replace(spec, options={**spec.options, "max_tokens": max_new_tokens})
    return spec


def _resolve(objective: str | ObjectiveSpec) -> ObjectiveSpec:
    try:
        return resolve_objective(objective)
    except (TypeError, ValueError) as error:
        raise SettingError(f"model.objective: {error}") from error
