"""DAPO's dynamic sampling (Yu et al., 2025, arXiv 2503.14476, section 3.2): a group whose G rewards are all equal
has advantages 0 and teaches nothing, so such groups are dropped and more prompts are drawn until the rollout batch
holds P informative groups again (or a cap on extra draws is reached).

Pure functions over ``Rollout``s: which groups inform, putting several samplings' groups into one rollout (their
prompt and response widths differ), and choosing the groups a round trains on.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from gspo_lightning.moe.rollout_routes import joined_routes
from gspo_lightning.rollout.types import EpisodeCounts, Rollout

# Rollout fields by how they are padded when rollouts of different widths are joined.
_LEFT_PADDED = ("prompt_ids", "prompt_mask")  # [N, Lp], the prompt's end aligned
# [N, R] (or [N, K] turns), with the value padding takes
_RIGHT_PADDED = {"response_ids": None, "response_mask": 0, "engine_logprobs": 0, "response_attention": 0,
                 "turn_index": -1, "turn_rewards": 0, "token_advantages": 0,
                 "policy_versions": -1}  # fmt: skip
_PER_RESPONSE = ("rewards", "advantages", "truncated", "prompt_cut", "prompt_skipped", "kl_penalties")  # [N]
_PER_RESPONSE_LISTS = ("completions", "prompts")  # N items


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """[P] bool: groups whose G rewards differ (some advantage is non-zero) and are all available (not NaN)."""
    grouped = rewards.view(-1, group_size)  # [P, G]
    available = ~grouped.isnan().any(-1)  # [P]
    return available & (grouped.amax(-1) > grouped.amin(-1))  # [P]


def concat_rollouts(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """One rollout holding every rollout's responses in order (prompt i of rollout 2 after all of rollout 1's)."""
    joined = {}
    for name in (*_LEFT_PADDED, *_RIGHT_PADDED):
        tensors = [getattr(r, name) for r in rollouts]
        if any(t is None for t in tensors):
            joined[name] = None
            continue
        width = max(t.shape[1] for t in tensors)
        pad = pad_token_id if name.endswith("_ids") else _RIGHT_PADDED.get(name, 0)
        left = name in _LEFT_PADDED
        joined[name] = torch.cat([F.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]), value=pad)
                                  for t in tensors])  # fmt: skip
    for name in _PER_RESPONSE:
        tensors = [getattr(r, name) for r in rollouts]
        joined[name] = None if any(t is None for t in tensors) else torch.cat([t.to(tensors[0].device) for t in tensors])
    for name in _PER_RESPONSE_LISTS:
        joined[name] = [item for r in rollouts for item in getattr(r, name)]
    joined["reward_components"] = {
        name: torch.cat([r.reward_components[name] for r in rollouts]) for name in rollouts[0].reward_components
    }
    routes = [r.routes for r in rollouts]
    joined["routes"] = None
    if all(r is not None for r in routes):  # [N, layers, Lp + R, k]: prompts and responses padded apart
        widths = [r.prompt_ids.shape[1] for r in rollouts]
        joined["routes"] = joined_routes(list(zip(routes, widths)), joined["prompt_ids"].shape[1],
                                         joined["response_ids"].shape[1])  # fmt: skip
    counts = [r.episodes for r in rollouts]
    joined["episodes"] = None if any(c is None for c in counts) else EpisodeCounts.cat(counts)
    return Rollout(**joined)


def select_groups(rollout: Rollout, groups: Tensor, group_size: int) -> Rollout:
    """The rollout restricted to ``groups`` ([k] group indices, in that order)."""
    rows = (groups[:, None] * group_size + torch.arange(group_size, device=groups.device)).reshape(-1)  # [k * G]
    values = {}
    for f in fields(rollout):
        value = getattr(rollout, f.name)
        if isinstance(value, Tensor):
            values[f.name] = value[rows.to(value.device)]
        elif f.name in _PER_RESPONSE_LISTS:  # may be empty (a rollout built without its texts)
            values[f.name] = [value[i] for i in rows.tolist()] if value else []
        elif f.name == "reward_components":
            values[f.name] = {name: scores[rows.to(scores.device)] for name, scores in value.items()}
        elif isinstance(value, EpisodeCounts):
            values[f.name] = value.select(rows)
    return replace(rollout, **values)


def choose_groups(informative: Tensor, wanted: int) -> Tensor:
    """Indices of ``wanted`` groups: the informative ones first (in order), then, when there are too few, the
    uninformative ones (advantages 0: they keep the batch's shape and teach nothing)."""
    order = torch.cat([informative.nonzero().flatten(), (~informative).nonzero().flatten()])  # [P_total]
    return order[:wanted]
