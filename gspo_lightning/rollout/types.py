"""Typed data passed between the stages of one rollout round.

    PromptDataModule --PromptBatch--> GroupSampler --Rollout/Minibatch--> training_step

Rows are group-contiguous everywhere: with P prompts and G responses per prompt, row ``i`` belongs to prompt
``i // G``. ``N = P * G`` is the number of responses in a rollout batch, ``n = N / K`` in one minibatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

Prompt = str | list[dict[str, str]]
"""A plain prompt string, or a chat conversation (list of ``{"role", "content"}`` messages)."""


@dataclass
class PromptBatch:
    """One dataloader item: the prompts of one rollout round, served once per optimizer step of that round.

    Attributes:
        prompts: P formatted prompts (strings, or chat messages when the chat template is used).
        columns: the data set's other columns, each a list of P values (e.g. ``answer``); passed to rewards.
        rollout_index: index of this rollout round on this rank (0, 1, 2, ...).
        minibatch_index: which of the round's K minibatches this optimizer step trains on (0 .. K-1).
        num_minibatches: K.
        minibatch: filled in by the sampler callback before ``training_step`` (``None`` until then).
    """

    prompts: list[Prompt]
    columns: dict[str, list[Any]]
    rollout_index: int = 0
    minibatch_index: int = 0
    num_minibatches: int = 1
    minibatch: Minibatch | None = None

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass
class Minibatch:
    """What one optimizer step trains on: n responses with everything the objective needs.

    Shapes (L = prompt length Lp + response length R, both trimmed to this minibatch):
        input_ids:      [n, L]  left-padded prompt followed by the right-padded response
        attention_mask: [n, L]  1 on real prompt and response tokens, 0 on padding (in an episode also on the
                                tool / environment tokens between the policy's turns)
        response_ids:   [n, R]  the sampled response tokens (the last R columns of input_ids); an episode's
                                turns with what came between them
        response_mask:  [n, R]  1 on the tokens the policy wrote (up to and including EOS), 0 elsewhere: every
                                loss, KL term, correction and diagnostic reduces over these only
        old_logprobs:   [n, R]  float32 log pi_old(y_t | x, y_<t), recorded right after sampling
        advantages:     [n]     group-normalised advantage of each response (Eq. 6), or [n, R] per token
                                (per-turn advantages of episodes)
        rewards:        [n]     the scalar reward of each response (NaN where a reward function failed and
                                ``reward_errors="skip"``: train on ``advantages``, which are then 0)
        ref_logprobs:   [n, R]  float32 log pi_ref, only when a KL penalty to a reference policy is used
        old_routes:     [n, layers, L, k]  int, the experts pi_old's forward used per token (MoE policies only:
                                its routers' own, or under R3 the sampler's where recorded, -1 where none was):
                                replayed by Routing Replay and compared with pi_theta's routing
        engine_logprobs: [n, R] float32 the sampling engine's log-probs of the same tokens, when pi_old is the
                                trainer's recomputation and the engine reported them: for the rollout-training
                                mismatch correction and metrics
        policy_lag:     [n]     int64, asynchronous rollouts: versions between the proximal pi_old and each
                                response's oldest token (for the clip fraction and the correction by lag)
        rollout_route_change: [layers] float32, the fraction of the sampler's (token, expert) pairs pi_old's
                                routers would have replaced (``moe/rollout_vs_old_change_frac``), when the sampling
                                engine recorded its experts
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    rewards: Tensor
    ref_logprobs: Tensor | None = None
    old_routes: Tensor | None = None
    engine_logprobs: Tensor | None = None
    policy_lag: Tensor | None = None
    rollout_route_change: Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def tensors(self) -> dict[str, Tensor]:
        """The fields that hold a tensor (``ref_logprobs``, ``old_routes`` and ``engine_logprobs`` may be None)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def to(self, device: torch.device | str) -> Minibatch:
        return replace(self, **{name: value.to(device) for name, value in self.tensors().items()})


@dataclass
class Rollout:
    """One rollout batch: P prompts x G sampled responses, scored, before the old-policy pass.

    Shapes:
        prompt_ids:     [N, Lp]  left-padded prompt tokens (each prompt repeated G times)
        prompt_mask:    [N, Lp]  1 on real prompt tokens
        response_ids:   [N, R]   sampled tokens, padded after EOS
        response_mask:  [N, R]   1 up to and including the first EOS
        rewards:        [N]      combined (weighted) reward; NaN where a reward function failed for the sample
                                 (``reward_errors="skip"``)
        advantages:     [N]      group-normalised advantages (Eq. 6); 0 for every response of a skipped group;
                                 None until the round's last stage computes them (``round_advantages``), once
        truncated:      [N]      bool, True when the response hit max_new_tokens without EOS
        prompt_cut:     [N]      bool, True where the prompt was cut to fit the context; None: nothing cut
        prompt_skipped: [N]      bool, True where the prompt's group is left out of learning because its prompt
                                 overflowed (``prompt_overflow="skip"``); None: nothing skipped
        engine_logprobs: [N, R] float32 log-probs of the sampled tokens as the sampling engine computed them, when
                                 it reported them (``old_logprobs="engine"``, a rollout correction, or an
                                 engine that reports them for free); else None
        kl_penalties:   [N]      float32 summed KL(pi_old || pi_ref) estimate of each response, when it was
                                 subtracted from the rewards (``kl_in="reward"``); else None
        response_attention: [N, R] 1 on every real token after the prompt, when that is more than the policy's
                                 own (multi-turn episodes: ``response_mask`` marks the policy's tokens, this also
                                 the tool / environment / template tokens between its turns, which the
                                 forward attends to but no loss reads); None: the same as ``response_mask``
        turn_index:     [N, R]   int64, the turn (0, 1, ...) each policy token belongs to, -1 elsewhere
                                 (episodes only, else None)
        turn_rewards:   [N, K]   float32, each turn's reward (the environment's, the reward functions' score
                                 added to the last turn), 0 after an episode's last turn (episodes only)
        token_advantages: [N, R] float32 per-token advantages (per-turn advantages of episodes,
                                 ``sampler.episodes.turn_advantages``); None: ``advantages`` for every token
        episodes:       per-episode counts (turns, tool calls, limits hit), for the metrics; None when single-turn
        policy_versions: [N, R] int64, the policy version that sampled each of the policy's tokens (rounds trained
                                 before it was sampled), -1 elsewhere; set by asynchronous rollouts, else None
        routes:         [N, layers, Lp + R, k] int, the experts the sampling engine's routers chose for each
                                 prompt and response token (Rollout Routing Replay), -1 where no forward read one
                                 (``gspo_lightning.moe.rollout_routes``); None unless the engine recorded them
        completions:    N response texts (EOS and what follows left out)
        prompts:        N prompts as the data module formatted them, each repeated G times
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    rewards: Tensor
    advantages: Tensor | None
    truncated: Tensor
    completions: list[str] = field(default_factory=list)
    prompts: list[Prompt] = field(default_factory=list)
    reward_components: dict[str, Tensor] = field(default_factory=dict)
    prompt_cut: Tensor | None = None
    prompt_skipped: Tensor | None = None
    engine_logprobs: Tensor | None = None
    kl_penalties: Tensor | None = None
    response_attention: Tensor | None = None
    turn_index: Tensor | None = None
    turn_rewards: Tensor | None = None
    token_advantages: Tensor | None = None
    episodes: EpisodeCounts | None = None
    policy_versions: Tensor | None = None
    routes: Tensor | None = None

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]


@dataclass
class EpisodeCounts:
    """What each of N episodes did, for the metrics (all [N]).

    Attributes:
        turns:           int64 policy turns taken
        tool_calls:      int64 tool calls made
        tool_errors:     int64 of them, malformed, to an unknown tool or with arguments the tool does not take
        policy_tokens:   int64 tokens the policy wrote (trained on)
        context_tokens:  int64 tokens between its turns that it did not write (tool results, observations,
                         template)
        truncated_turns: bool, stopped at ``max_turns`` without finishing
        truncated_turn_tokens: bool, a turn hit ``model.max_new_tokens`` without EOS
        truncated_context: bool, the episode reached ``max_episode_tokens``
        failed:          bool, the environment or a tool failed (``reward_errors: skip``; reward NaN)
    """

    turns: Tensor
    tool_calls: Tensor
    tool_errors: Tensor
    policy_tokens: Tensor
    context_tokens: Tensor
    truncated_turns: Tensor
    truncated_turn_tokens: Tensor
    truncated_context: Tensor
    failed: Tensor

    def select(self, rows: Tensor) -> EpisodeCounts:
        """The counts of ``rows`` ([k] indices), in that order."""
        return EpisodeCounts(**{f.name: getattr(self, f.name)[rows.to(self.turns.device)] for f in fields(self)})

    @staticmethod
    def cat(parts: list[EpisodeCounts]) -> EpisodeCounts:
        """One set of counts holding every part's episodes in order."""
        return EpisodeCounts(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(EpisodeCounts)})
