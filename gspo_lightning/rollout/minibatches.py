"""Splitting a rollout batch into K minibatches and recording the old policy's log-probs.

pi_old is not a second copy of the weights: it is what the sampling policy said about each sampled token,
computed here, right after sampling and before any update, with the same function and on the same tensors
that ``training_step`` will use. On the first minibatch of a round the ratio is therefore exactly 1.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gspo_lightning.logprobs import DEFAULT_CHUNK_SIZE, response_logprobs
from gspo_lightning.moe.routing import capture_routes
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


def _trimmed_rows(rollout: Rollout, rows: slice) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Prompt + response tensors for ``rows``, without the padding columns no row of them needs."""
    prompt_mask = rollout.prompt_mask[rows]  # [n, Lp]
    response_mask = rollout.response_mask[rows]  # [n, R]
    prompt_len = max(int(prompt_mask.sum(-1).max()), 1)
    response_len = max(int(response_mask.sum(-1).max()), 1)
    prompt_ids = rollout.prompt_ids[rows, -prompt_len:]  # [n, Lp'] left padding: keep the right end
    response_ids = rollout.response_ids[rows, :response_len]  # [n, R']
    response_mask = response_mask[:, :response_len]  # [n, R']
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # [n, Lp' + R']
    attention_mask = torch.cat([prompt_mask[:, -prompt_len:], response_mask], dim=1)  # [n, Lp' + R']
    return input_ids, attention_mask, response_ids, response_mask


@torch.no_grad()
def split_minibatches(
    rollout: Rollout,
    num_minibatches: int,
    policy: nn.Module,
    temperature: float = 1.0,
    reference: nn.Module | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    old_from_engine: bool = False,
    mask_truncated: bool = False,
) -> list[Minibatch]:
    """Cut the rollout into K contiguous minibatches and attach pi_old's per-token log-probs to each.

    Contiguous rows keep a prompt's G responses together whenever G divides N / K. With ``old_from_engine`` the
    engine's own log-probs (``rollout.engine_logprobs``) are pi_old; otherwise they are recomputed here and the
    engine's, when the rollout has them, travel along as ``engine_logprobs`` (mismatch correction). With a ``reference``
    policy (KL penalty), its log-probs are recorded too, on the reference's own device (it may live on CPU). With
    ``mask_truncated`` the responses that never reached EOS get an empty response mask (left out of the loss).
    Call it inside the same precision context as ``training_step``.
    """
    check_divisible(len(rollout), num_minibatches)
    size = len(rollout) // num_minibatches
    minibatches = []
    for k in range(num_minibatches):
        rows = slice(k * size, (k + 1) * size)
        input_ids, attention_mask, response_ids, response_mask = _trimmed_rows(rollout, rows)
        engine = None if rollout.engine_logprobs is None else rollout.engine_logprobs[rows, : response_ids.shape[1]]
        if old_from_engine:  # pi_old as the engine saw it: no second forward
            if engine is None:
                raise ValueError("old_from_engine needs the engine's log-probs in the rollout (engine_logprobs)")
            old_logprobs, engine, routes = engine, None, None  # [n, R']
        else:
            with capture_routes(policy, tuple(input_ids.shape)) as routes:  # MoE: pi_old's experts per token
                old_logprobs = response_logprobs(
                    policy, input_ids, attention_mask, response_ids.shape[1], temperature, chunk_size
                )  # [n, R']
        ref_logprobs = (
            None
            if reference is None
            else _reference_logprobs(
                reference, input_ids, attention_mask, response_ids.shape[1], temperature, chunk_size
            )
        )  # [n, R']
        if mask_truncated:  # after pi_old's forward, which still sees every token
            response_mask = response_mask * ~rollout.truncated[rows, None].to(response_mask.device)  # [n, R']
        minibatches.append(
            Minibatch(
                input_ids=input_ids,
                attention_mask=attention_mask,
                response_ids=response_ids,
                response_mask=response_mask,
                old_logprobs=old_logprobs.float(),
                advantages=rollout.advantages[rows],
                rewards=rollout.rewards[rows],
                ref_logprobs=ref_logprobs,
                old_routes=routes.stacked() if routes and routes.indices else None,  # [n, layers, L, k]
                engine_logprobs=None if engine is None else engine.float(),  # [n, R']
            )
        )
    return minibatches


def _reference_logprobs(
    reference: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_length: int,
    temperature: float,
    chunk_size: int,
) -> Tensor:
    """pi_ref's log-probs, computed where the reference lives and returned on the policy's device."""
    device = next(reference.parameters()).device
    logprobs = response_logprobs(
        reference, input_ids.to(device), attention_mask.to(device), response_length, temperature, chunk_size
    )  # [n, R]
    return logprobs.float().to(input_ids.device)
