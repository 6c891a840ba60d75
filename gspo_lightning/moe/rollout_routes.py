"""Rollout Routing Replay (R3): the experts the sampler chose for each token, from sampling to training.

Routing Replay against pi_old (R2, ``routing_replay: old``) replays the experts of the trainer's own pi_old forward.
When the sampler is not that forward (another precision, kernels, process, or an older policy under asynchronous
rollouts), the experts that produced a sample differ from those, most of all in MoE layers. R3 (``routing_replay:
rollout``) records the experts at sampling time and forces them in the pi_old, reference and pi_theta forwards.

A route tensor holds, per token and MoE layer, the k experts chosen: [..., layers, T, k] integers, with
``NOT_RECORDED`` (-1) for a token no sampling forward read (a response's last token, which nothing reads; padding):
replay lets the router choose there (its output reaches no scored token). A token read by several forwards (an
episode's history, prefilled again each turn) keeps the experts of the first one. Pure tensor functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gspo_lightning.moe.routing import NOT_RECORDED, expert_change_fraction, find_routers


class RouteLayoutError(ValueError):
    """Recorded routes do not line up with the sequence they are for (length, layers or top-k)."""


def first_read(known: Tensor | None, new: Tensor) -> Tensor:
    """An episode's routes after one more engine call: ``known`` [layers, T0, k] (None: nothing yet) where it holds
    a recorded entry, ``new`` [layers, T1, k] (T1 >= T0, the same tokens first) everywhere else."""
    if known is None:
        return new
    if new.shape[1] < known.shape[1] or new.shape[::2] != known.shape[::2]:
        raise RouteLayoutError(f"routes of shape {tuple(new.shape)} cannot extend routes of {tuple(known.shape)}")
    head = torch.where(known != NOT_RECORDED, known, new[:, : known.shape[1]])  # [layers, T0, k]
    return torch.cat([head, new[:, known.shape[1] :]], dim=1)  # [layers, T1, k]


def call_segment(routes: Tensor, row: int, context: int, new_tokens: int, response_width: int) -> Tensor:
    """One row's routes from an engine call, from its first context token to its last kept new token.

    Args:
        routes: [rows, layers, Lc + R, k] what the call recorded over its left-padded contexts [rows, Lc] and
            responses [rows, R].
        context: the row's context length (its real tokens end at column Lc).
        new_tokens: how many of its sampled tokens are kept.
        response_width: R.
    Returns:
        [layers, context + new_tokens, k].
    """
    width = routes.shape[2] - response_width  # Lc
    if context > width or new_tokens > response_width:
        raise RouteLayoutError(
            f"the sampling engine reported routed experts over {width} context and {response_width} response "
            f"columns for a row of {context} context tokens and {new_tokens} new ones: they must line up exactly "
            "(model.routing_replay: rollout)"
        )
    return routes[row, :, width - context : width + new_tokens]


def rollout_routes(rows: list[Tensor], prompt_lengths: list[int], prompt_width: int, response_width: int) -> Tensor:
    """Each trajectory's routes ([layers, T_i, k] over its prompt and response tokens, T_i at most their count) in
    the rollout's layout: [N, layers, Lp + R, k], prompts left-padded to ``prompt_width``, responses right-padded
    to ``response_width``, ``NOT_RECORDED`` where nothing was recorded."""
    layers, _, k = rows[0].shape
    out = torch.full((len(rows), layers, prompt_width + response_width, k), NOT_RECORDED, dtype=rows[0].dtype)
    for index, (routes, prompt) in enumerate(zip(rows, prompt_lengths, strict=True)):
        start = prompt_width - prompt
        out[index, :, start : start + routes.shape[1]] = routes.to(out.device)
    return out


def joined_routes(parts: list[tuple[Tensor, int]], prompt_width: int, response_width: int) -> Tensor:
    """Rollouts' routes ([N_i, layers, Lp_i + R_i, k] with prompt width Lp_i each) in one layout of
    ``prompt_width`` + ``response_width`` columns: prompts padded on the left, responses on the right."""
    joined = []
    for routes, width in parts:
        prompt, response = routes[:, :, :width], routes[:, :, width:]
        prompt = F.pad(prompt, (0, 0, prompt_width - width, 0), value=NOT_RECORDED)
        response = F.pad(response, (0, 0, 0, response_width - response.shape[2]), value=NOT_RECORDED)
        joined.append(torch.cat([prompt, response], dim=2))
    return torch.cat(joined)


def route_shape(policy: nn.Module) -> tuple[int, int]:
    """(MoE layers, top-k) of ``policy``'s routers: what every token's routes must hold."""
    routers = find_routers(policy)
    return len(routers), (int(routers[0].top_k) if routers else 0)


def check_routes(routes: Tensor, sequences: int, length: int, layers: int, top_k: int, source: str) -> None:
    """Routes arriving from ``source`` must be [sequences, layers, length, top_k] for the sequences they describe:
    a clear error instead of experts shifted onto the wrong tokens."""
    want = (sequences, layers, length, top_k)
    if tuple(routes.shape) != want:
        raise RouteLayoutError(
            f"{source} reported routed experts of shape {tuple(routes.shape)} (sequences, layers, tokens, top-k) "
            f"for {sequences} sequences of {length} tokens through {layers} MoE layers with top-{top_k} routing: "
            "they must match exactly (model.routing_replay: rollout)"
        )


def replayed_routes(recorded: Tensor, natural: Tensor) -> Tensor:
    """What a forward replaying ``recorded`` [n, layers, L, k] used: the recorded experts, and the router's own
    ``natural`` [n, layers, L, k] choice where nothing was recorded."""
    return torch.where(recorded != NOT_RECORDED, recorded, natural.to(recorded.dtype))


def rollout_change_fraction(recorded: Tensor, natural: Tensor, token_mask: Tensor) -> Tensor:
    """Per layer, the fraction of the sampler's (token, expert) pairs the trainer's router would have replaced:
    ``natural`` [n, layers, L, k] pi_old's own choice against ``recorded`` [n, layers, L, k] the sampler's, over
    the real tokens (``token_mask`` [n, L]) that have a record. [layers] float32."""
    has_record = (recorded[:, 0, :, 0] != NOT_RECORDED).to(token_mask.dtype)  # [n, L]
    return expert_change_fraction(recorded, natural.to(recorded.dtype), token_mask * has_record)
