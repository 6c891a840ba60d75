"""The seam between the rollout and whatever draws its responses: Hugging Face ``generate`` or an inference engine.

A round of sampling, in the order it happens (``GroupSampler`` and ``HeldOutEvaluation`` drive it):

    engine.reserve(need)                     before setup: what a round holds at once (an engine may size by it)
    engine.setup(trainer, module)            once, at fit start: build the engine for this policy
    engine.before_rollout(trainer, module)   every round: wake it, and bring it the trainer's current weights
    engine.sample(...)                       G responses per prompt -> EngineSamples
    engine.after_rollout()                   every round: free what it holds while training runs

An engine is owned by the sampler (the evaluation borrows the sampler's), never by the LightningModule: the module
only ever sees token ids and log-probs in a ``Minibatch``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from transformers import GenerationConfig, PreTrainedTokenizerBase


@dataclass(frozen=True)
class SamplingSettings:
    """How responses are drawn. ``temperature=0`` means greedy decoding; ``top_k=0`` disables top-k.

    Responses are drawn from exactly softmax(logits / temperature), restricted by ``top_p`` / ``top_k`` only when
    they are set: no other logits processor runs, whatever the checkpoint's ``generation_config.json`` asks for
    (see :func:`neutral_generation_defaults`).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def generation_config(self, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
        greedy = self.temperature == 0
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else self.temperature,
            top_p=None if greedy else self.top_p,
            top_k=None if greedy else self.top_k,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            # Every processor whose neutral value is not None, set explicitly: generate() fills unset fields
            # from the model's generation config, and these would otherwise come from the checkpoint's.
            num_beams=1,
            num_return_sequences=1,
            # min_new_tokens stays None: set beside min_length, transformers warns on every call (and the
            # checkpoint's value cannot reach generate, which samples under neutral_generation_defaults)
            min_length=0,
            repetition_penalty=1.0,
            encoder_repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            encoder_no_repeat_ngram_size=0,
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            renormalize_logits=False,
            remove_invalid_values=False,
        )


@dataclass(frozen=True)
class RoundNeed:
    """What one sampling round holds at once, for an engine that sizes its memory by it (vLLM's KV cache).

    Attributes:
        sequences: sequences sampled together (P x G responses, or episodes).
        tokens: tokens one of them may reach (its prompt with ``max_new_tokens``, or an episode's budget).
    """

    sequences: int
    tokens: int

    def merged(self, other: RoundNeed | None) -> RoundNeed:
        """The larger of both on each count (a sampler's and an evaluation's need of one engine)."""
        if other is None:
            return self
        return RoundNeed(max(self.sequences, other.sequences), max(self.tokens, other.tokens))


@dataclass
class EngineSamples:
    """What an engine drew: ``group_size`` responses per prompt, prompt i's at rows i*G .. i*G + G - 1.

    Shapes (N = P * G; R <= max_new_tokens, the longest response drawn):
        response_ids:   [N, R] int64 sampled tokens, the tokenizer's pad id after a response ended
        ended:          [N] bool, True where the response ended with the tokenizer's EOS (else it hit
                        max_new_tokens)
        logprobs:       [N, R] float32 log-probs of the sampled tokens under the distribution sampled from,
                        log softmax(logits / temperature) as the engine computed them (0 after the end); None when
                        not asked for
        routes:         [N, layers, Lp + R, k] int, the experts a mixture-of-experts policy's routers chose for
                        each prompt and response token as the engine sampled (Rollout Routing Replay), over the
                        call's left-padded prompt columns then the response's; ``NOT_RECORDED`` (-1) for a token no
                        forward read (the last sampled); None when not asked for
                        (``gspo_lightning.moe.rollout_routes``)
    """

    response_ids: Tensor
    ended: Tensor
    logprobs: Tensor | None = None
    routes: Tensor | None = None

    def __len__(self) -> int:
        return self.response_ids.shape[0]


class SamplingEngine(ABC):
    """Draws responses for the rollout and the held-out evaluation (see the module docstring for the lifecycle).

    Every engine samples from exactly softmax(logits / temperature), restricted by ``top_p`` / ``top_k`` only when
    the settings ask for it, and stops a response at the tokenizer's EOS or at ``max_new_tokens``.
    """

    name = "engine"
    reports_logprobs_cheaply = False
    """Whether ``sample(..., with_logprobs=True)`` costs nothing extra (then the sampler always asks, for the
    rollout-training mismatch metrics)."""
    seed = 0
    """The seed of an engine with random streams of its own (vLLM's): each round's ``sample`` seed is a function
    of it, the round and the rank. An engine drawing from torch's generator (``generate``) leaves it 0."""
    tensor_parallel_size = 1
    """How many training ranks one engine spans (vLLM's tensor parallelism); 1 for an engine per rank."""
    runs_in_background = False
    """Whether the engine samples beside training, on a thread of the trainer's process, from weights handed over
    with ``snapshot_weights`` / ``load_snapshot`` (it never runs the trainer's policy): what
    ``sampler.asynchronous.mode: streaming`` needs, and what lets fixed lag overlap sampling with training."""

    records_routes = False
    """Whether ``sample(..., with_routes=True)`` reports each token's experts, once set up: the sampler then asks in
    every round of a mixture-of-experts policy (``model.routing_replay: rollout``, and the routing-change
    diagnostic without it)."""

    def routes_refusal(self, device: torch.device) -> str | None:
        """Why the engine cannot record each token's experts for a trainer on ``device``, and what to use instead
        (named in the error that refuses ``model.routing_replay: rollout``); None where it can. Asked before
        ``setup``, and again after it for what only setup finds out (e.g. servers started without routes)."""
        return None if self.records_routes else "it does not report the experts its forwards chose"

    need: RoundNeed | None = None
    """What a round holds at once, as the callbacks that sample with this engine ``reserve`` it."""

    def reserve(self, need: RoundNeed) -> None:
        """Before ``setup``: a round of ``need`` will be sampled (the largest of every caller's is kept). An engine
        that sizes its memory reads ``self.need`` when it is built; one reserved after that samples larger
        rounds in waves."""
        self.need = need.merged(self.need)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Once, when training starts (the policy exists): build what the engine needs."""

    def before_rollout(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Before each sampling round: the engine must sample from the trainer's current weights."""

    def after_rollout(self) -> None:
        """After each sampling round (training runs next)."""

    def teardown(self) -> None:
        """When training ends."""

    def take_figures(self) -> dict[str, float]:
        """The engine's own figures since the last call (weight syncs, requests), which the sampler logs under
        ``engine/`` with each new round; none by default."""
        return {}

    def snapshot_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        """The trainer's current weights, taken now, for a later ``load_snapshot`` on the engine's thread (an engine
        that ``runs_in_background`` only)."""
        raise NotImplementedError(f"{type(self).__name__} does not sample in the background: it takes no snapshots")

    def load_snapshot(self, snapshot: Any) -> None:
        """Sample from ``snapshot``'s weights from now on (an engine that ``runs_in_background`` only)."""
        raise NotImplementedError(f"{type(self).__name__} does not sample in the background: it loads no snapshots")

    @abstractmethod
    def sample(
        self,
        policy: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        settings: SamplingSettings,
        group_size: int,
        with_logprobs: bool = False,
        synced_gpus: bool = False,
        seed: int = 0,
        with_routes: bool = False,
    ) -> EngineSamples:
        """``group_size`` responses for each of the P left-padded prompts ``prompt_ids`` [P, Lp] (mask [P, Lp]).

        ``with_routes``: also report each token's experts (``EngineSamples.routes``; engines that
        ``records_routes`` only).

        ``seed`` makes an engine with its own random streams reproducible (a function of the run's seed, the
        round and the rank); ``generate`` draws from torch's generator, which the sampler saves and restores.
        ``synced_gpus``: parameters are sharded, every rank must keep stepping until all have finished.
        """


def refuse_routes(engine: SamplingEngine, with_routes: bool) -> None:
    """Stop a request for routed experts that ``engine`` cannot serve (R3 refuses such an engine at setup)."""
    if with_routes and not engine.records_routes:
        raise NotImplementedError(f"sampler.engine: {engine.name} cannot report routed experts as it is set up "
                                  "(SamplingEngine.routes_refusal says why)")  # fmt: skip


def ended_with_eos(response_ids: Tensor, eos_token_id: int) -> Tensor:
    """[N] bool: which responses [N, R] hold the EOS token."""
    return (response_ids == eos_token_id).any(-1)


def padded(rows: list[list[Any]], value: Any, dtype: torch.dtype = torch.long, left: bool = False) -> Tensor:
    """Lists of different lengths as one [N, longest] tensor (at least one column), ``value`` filling the rest:
    after each row, or before it with ``left`` (prompts, whose end must line up)."""
    width = max((len(row) for row in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), value, dtype=dtype)
    for index, row in enumerate(rows):
        if row:
            target = out[index, width - len(row) :] if left else out[index, : len(row)]
            target.copy_(torch.as_tensor(row, dtype=dtype))
    return out


def right_padded(rows: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> Tensor:
    """Token lists of different lengths as one [N, max length] int64 tensor, ``pad_id`` after each."""
    return padded(rows, pad_id).to(device)


def response_mask_until_eos(response_ids: Tensor, eos_token_id: int) -> tuple[Tensor, Tensor]:
    """Mask of the tokens up to and including the first EOS, and which responses never reached EOS.

    Returns:
        mask: [N, R] long, 1 on response tokens (EOS included: the policy must learn to stop).
        truncated: [N] bool, True where no EOS was produced within max_new_tokens.
    """
    is_eos = (response_ids == eos_token_id).long()  # [N, R]
    eos_before = is_eos.cumsum(-1) - is_eos  # [N, R] EOS tokens strictly before t
    mask = (eos_before == 0).long()  # [N, R]
    truncated = is_eos.sum(-1) == 0  # [N]
    return mask, truncated


def decode_responses(tokenizer: PreTrainedTokenizerBase, response_ids: Tensor, response_mask: Tensor) -> list[str]:
    """The text of each response, without EOS and what follows it."""
    lengths = response_mask.sum(-1).tolist()
    rows = [ids[:length] for ids, length in zip(response_ids.tolist(), lengths)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
