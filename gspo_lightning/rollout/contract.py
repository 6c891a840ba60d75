"""What ``GroupSampler`` needs from a LightningModule: ``SamplerModule``, checked once when a fit starts.

``GSPOModule`` has all of it; another module reusing the sampler sets what it does not use to the neutral value
(``reference_policy = None``, ``kl_reward_penalty = None``, ``routing_replay = "off"``,
``rollout_correction = RolloutCorrection()``, ``needs_engine_logprobs = False``, ``policy_loader = None``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from gspo_lightning.micro_batches import BatchLayout
from gspo_lightning.objectives import KLRewardPenalty, RolloutCorrection
from gspo_lightning.moe.routing import find_routers
from gspo_lightning.rollout.round import RoundModel
from gspo_lightning.validation import SettingError


@runtime_checkable
class SamplerModule(Protocol):
    """The LightningModule side of a rollout round.

    Attributes:
        policy: the Hugging Face causal LM being trained (may be built in ``configure_model``: None until then).
        tokenizer: its tokenizer (pad and EOS tokens set).
        temperature: the temperature of the module's log-probs, and so the sampling temperature: pi_old and
            pi_theta must describe the distribution the responses were drawn from.
        max_new_tokens: the longest response the sampler draws (and e.g. Dr. GRPO's constant normaliser).
        reference_policy: the frozen pi_ref whose log-probs a KL penalty needs, or None.
        kl_reward_penalty: the coefficient and estimator when the KL is subtracted from the rewards, or None.
        routing_replay: MoE policies: ``off``, ``old`` (pi_old's experts replayed) or ``rollout`` (the
            sampling engine's experts recorded and replayed).
        rollout_correction: the rollout-training mismatch correction (its ``mode`` is ``off`` when unused).
        needs_engine_logprobs: the module's loss uses the engine's log-probs of the sampled tokens.
        per_token_advantages: the module's loss takes one advantage per token ([n, R]: per-turn advantages of
            episodes, ``sampler.episodes.turn_advantages``), not only one per response.
        policy_loader: what built the policy (named in errors about its tokenizer), or None.
        logprob_chunk_size: response tokens per chunk of the LM head (0: unchunked), for pi_old's pass too.
        batch_layout: how pi_old's and the reference's passes lay out a minibatch (packed, by token budget), as
            the module's own pass does (``gspo_lightning.micro_batches.BatchLayout``).
        device: where the policy's inputs go.
    """

    policy: nn.Module | None
    tokenizer: PreTrainedTokenizerBase | None
    temperature: float
    max_new_tokens: int
    reference_policy: nn.Module | None
    kl_reward_penalty: KLRewardPenalty | None
    routing_replay: str
    rollout_correction: RolloutCorrection
    needs_engine_logprobs: bool
    per_token_advantages: bool
    policy_loader: Any
    logprob_chunk_size: int
    batch_layout: BatchLayout
    device: torch.device


CONTRACT: tuple[str, ...] = tuple(SamplerModule.__annotations__)


def check_sampler_module(module: Any) -> SamplerModule:
    """``module`` itself once it has every attribute of ``SamplerModule``; a ``SettingError`` naming the missing
    ones otherwise (their values may still be None: ``policy`` before ``configure_model``)."""
    missing = [name for name in CONTRACT if not hasattr(module, name)]
    if missing:
        raise SettingError(
            f"GroupSampler needs the LightningModule ({type(module).__name__}) to have {', '.join(missing)}: see "
            "gspo_lightning.rollout.contract.SamplerModule (docs/reuse.md)"
        )
    return module


def check_built(module: SamplerModule) -> None:
    """The module's policy and tokenizer exist (``configure_model`` has run)."""
    for name in ("policy", "tokenizer"):
        if getattr(module, name) is None:
            raise SettingError(f"GroupSampler needs the LightningModule's {name} by the time training starts")


def round_model(
    module: SamplerModule, engine_logprobs: bool, synced_gpus: bool, engine_routes: bool = False
) -> RoundModel:
    """The parts of the module a round uses, once the policy is built; ``engine_routes``: the engine can record each
    token's experts (they are asked for when the policy has routers)."""
    check_built(module)
    return RoundModel(
        module.policy, module.tokenizer, module.temperature, module.max_new_tokens, module.device,
        reference=module.reference_policy, kl_reward_penalty=module.kl_reward_penalty,
        chunk_size=module.logprob_chunk_size, layout=module.batch_layout,
        engine_logprobs=engine_logprobs or module.needs_engine_logprobs, synced_gpus=synced_gpus,
        engine_routes=engine_routes and bool(find_routers(module.policy)), routing_replay=module.routing_replay,
    )  # fmt: skip
