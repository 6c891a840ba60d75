"""Recording the old policy's log-probs over a rollout batch and assembling its K minibatches.

pi_old is not a second copy of the weights: it is what the sampling policy said about each sampled token,
computed here, right after sampling and before any update, with the same function and on the same tensors
that ``training_step`` will use. On the first minibatch of a round the ratio is therefore exactly 1.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from gspo_lightning.logprobs import DEFAULT_CHUNK_SIZE, response_logprobs
from gspo_lightning.micro_batches import BatchLayout
from gspo_lightning.moe.rollout_routes import check_routes, replayed_routes, rollout_change_fraction, route_shape
from gspo_lightning.moe.routing import capture_routes, find_routers, replay_routes
from gspo_lightning.rollout.types import Minibatch, Rollout
from gspo_lightning.validation import SettingError


def check_divisible(num_responses: int, num_minibatches: int) -> None:
    """K must split the N responses of a round evenly, so every optimizer step sees the same batch size."""
    if num_minibatches < 1 or num_responses % num_minibatches != 0:
        divisors = [k for k in range(1, num_responses + 1) if num_responses % k == 0]
        raise SettingError(
            f"sampler.num_minibatches={num_minibatches} must divide the rollout batch of {num_responses} responses "
            f"(data.prompts_per_rollout x sampler.group_size); allowed: {divisors}"
        )


def _trimmed_rows(rollout: Rollout, rows: slice) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Prompt + response tensors for ``rows``, without the padding columns no row of them needs; the sampler's
    routes over the same columns (None when not recorded)."""
    prompt_mask = rollout.prompt_mask[rows]  # [n, Lp]
    # An episode's policy tokens are not all it attends to: the tool results between its turns count too.
    attended = rollout.response_mask if rollout.response_attention is None else rollout.response_attention
    attended = attended[rows]  # [n, R], contiguous from the first response column
    prompt_len = max(int(prompt_mask.sum(-1).max()), 1)
    response_len = max(int(attended.sum(-1).max()), 1)
    prompt_ids = rollout.prompt_ids[rows, -prompt_len:]  # [n, Lp'] left padding: keep the right end
    response_ids = rollout.response_ids[rows, :response_len]  # [n, R']
    response_mask = rollout.response_mask[rows, :response_len]  # [n, R']
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # [n, Lp' + R']
    attention_mask = torch.cat([prompt_mask[:, -prompt_len:], attended[:, :response_len]], dim=1)  # [n, Lp' + R']
    routes = None
    if rollout.routes is not None:  # [n, layers, Lp' + R', k], the same columns
        width = rollout.prompt_ids.shape[1]
        routes = rollout.routes[rows, :, width - prompt_len : width + response_len].to(input_ids.device)
    return input_ids, attention_mask, response_ids, response_mask, routes


@dataclass
class PolicyPass:
    """One minibatch's rows after the old-policy pass: a ``Minibatch`` before its advantages and rewards.

    Shapes as in ``Minibatch`` (trimmed to these n rows): input_ids / attention_mask [n, L], response_ids /
    response_mask [n, R] (empty for a truncated response under ``mask_truncated``), old_logprobs [n, R] float32,
    ref_logprobs [n, R] or None, old_routes [n, layers, L, k] or None (the experts pi_old's forward used: its own,
    or under R3 the sampler's where recorded), engine_logprobs [n, R] or None, rollout_route_change [layers] or None
    (the fraction of the sampler's experts pi_old's routers would have replaced, when the sampler recorded them).
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    old_logprobs: Tensor
    ref_logprobs: Tensor | None = None
    old_routes: Tensor | None = None
    engine_logprobs: Tensor | None = None
    rollout_route_change: Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@torch.no_grad()
def policy_passes(
    rollout: Rollout, num_minibatches: int, policy: nn.Module, temperature: float = 1.0,
    reference: nn.Module | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE, old_from_engine: bool = False,
    mask_truncated: bool = False, layout: BatchLayout = BatchLayout(), routing_replay: str = "off",
) -> list[PolicyPass]:  # fmt: skip
    """Cut the rollout into K contiguous row blocks and record pi_old's per-token log-probs for each.

    Contiguous rows keep a prompt's G responses together whenever G divides N / K; one block at a time bounds
    the pass's memory by a minibatch. With ``old_from_engine`` the engine's own log-probs
    (``rollout.engine_logprobs``) are pi_old; otherwise they are recomputed here (MoE policies: with pi_old's
    experts per token) and the engine's, when the rollout has them, travel along (mismatch correction). With a
    ``reference`` policy (KL penalty) its log-probs are recorded too, on the reference's own device. With
    ``mask_truncated`` the responses that never reached EOS get an empty response mask (left out of the loss).
    Every forward lays out the block's sequences as ``layout`` says (packed, by token budget), as
    ``training_step`` does. With ``routing_replay: rollout`` (R3) the sampler's experts (``rollout.routes``) are
    forced in the pi_old and reference forwards and become the minibatch's ``old_routes``.
    Call it inside the same precision context as ``training_step``.
    """
    check_divisible(len(rollout), num_minibatches)
    size = len(rollout) // num_minibatches
    passes = []
    for k in range(num_minibatches):
        rows = slice(k * size, (k + 1) * size)
        input_ids, attention_mask, response_ids, response_mask, recorded = _trimmed_rows(rollout, rows)
        width = response_ids.shape[1]
        engine = None if rollout.engine_logprobs is None else rollout.engine_logprobs[rows, :width]  # [n, R']
        if recorded is not None:  # the sampler's routes must describe these very tokens
            check_routes(recorded, *input_ids.shape, *route_shape(policy), "the sampling engine")
        replayed = recorded if routing_replay == "rollout" else None  # [n, layers, L, k] or None
        change = None
        if old_from_engine:  # pi_old as the engine saw it: no second forward
            if engine is None:
                raise ValueError("old_from_engine needs the engine's log-probs in the rollout (engine_logprobs)")
            old_logprobs, engine, routes = engine, None, replayed  # [n, R']
        else:
            with _routes_block(policy, tuple(input_ids.shape), replayed) as capture:  # MoE: the experts per token
                old_logprobs = response_logprobs(
                    policy, input_ids, attention_mask, width, temperature, chunk_size, layout
                )  # [n, R']
            routes, change = _old_routes(capture, recorded, replayed, attention_mask)
        ref_logprobs = None
        if reference is not None:
            forced = None if replayed is None else routes  # R3: the experts pi_old's forward used
            with _routes_block(reference, tuple(input_ids.shape), forced, required=False):
                ref_logprobs = _reference_logprobs(
                    reference, input_ids, attention_mask, width, temperature, chunk_size, layout
                )  # [n, R']
        if mask_truncated:  # after pi_old's forward, which still sees every token
            response_mask = response_mask * ~rollout.truncated[rows, None].to(response_mask.device)  # [n, R']
        passes.append(
            PolicyPass(
                input_ids, attention_mask, response_ids, response_mask,
                old_logprobs=old_logprobs.float(),  # [n, R']
                ref_logprobs=ref_logprobs,  # [n, R'] or None
                old_routes=routes,  # [n, layers, L, k] or None
                engine_logprobs=None if engine is None else engine.float(),  # [n, R']
                rollout_route_change=change,  # [layers] or None
            )
        )  # fmt: skip
    return passes


def assemble_minibatches(passes: list[PolicyPass], rollout: Rollout) -> list[Minibatch]:
    """The K minibatches: each block's pass with its rows' advantages and rewards from ``rollout``."""
    if rollout.advantages is None:
        raise ValueError("the rollout's advantages are computed before its minibatches are assembled")
    minibatches, start = [], 0
    for part in passes:
        rows = slice(start, start + len(part))
        start += len(part)
        fields_ = {f.name: getattr(part, f.name) for f in fields(part)}
        advantages = rollout.advantages[rows]  # [n]
        if rollout.token_advantages is not None:  # per-turn advantages: one per token
            advantages = rollout.token_advantages[rows, : part.response_ids.shape[1]]  # [n, R']
        minibatches.append(Minibatch(**fields_, advantages=advantages, rewards=rollout.rewards[rows]))
    return minibatches


def split_minibatches(
    rollout: Rollout, num_minibatches: int, policy: nn.Module, temperature: float = 1.0, **options: Any
) -> list[Minibatch]:
    """``policy_passes`` and ``assemble_minibatches`` with the rollout's own advantages (tests, notebooks)."""
    return assemble_minibatches(policy_passes(rollout, num_minibatches, policy, temperature, **options), rollout)


def _routes_block(model: nn.Module, shape: tuple[int, int], replayed: Tensor | None, required: bool = True):
    """The forwards' experts captured, or ``replayed`` forced (R3). ``required`` False (the reference): nothing to
    capture, and a model without as many routers as the routes have layers (a dense reference) runs as it is."""
    if not required and (replayed is None or len(find_routers(model)) != replayed.shape[1]):
        return nullcontext()
    return capture_routes(model, shape) if replayed is None else replay_routes(model, replayed)


def _old_routes(
    capture: Any, recorded: Tensor | None, replayed: Tensor | None, attention_mask: Tensor
) -> tuple[Tensor | None, Tensor | None]:
    """What pi_old's forward routed to ([n, layers, L, k]; None for a dense policy) and, when the sampler recorded
    its experts, the per-layer fraction pi_old's routers would have replaced ([layers])."""
    if not capture.indices:
        return None, None
    natural = capture.stacked()  # [n, layers, L, k] the router's own choice
    used = natural if replayed is None else replayed_routes(replayed, natural)
    if recorded is None:
        return used, None
    return used, rollout_change_fraction(recorded, natural, attention_mask)


def _reference_logprobs(
    reference: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_length: int, temperature: float,
    chunk_size: int, layout: BatchLayout = BatchLayout(),
) -> Tensor:  # fmt: skip
    """pi_ref's log-probs, computed where the reference lives and returned on the policy's device."""
    device = next(reference.parameters()).device
    logprobs = response_logprobs(
        reference, input_ids.to(device), attention_mask.to(device), response_length, temperature, chunk_size,
        layout,
    )  # [n, R]
    return logprobs.float().to(input_ids.device)
