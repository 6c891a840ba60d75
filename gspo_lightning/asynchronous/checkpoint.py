"""Sampled rounds not yet trained, as plain data: a checkpoint is loaded with ``torch.load(weights_only=True)``,
which takes tensors, numbers, strings, lists and dicts only."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from torch import Tensor

from gspo_lightning.asynchronous.producer import SampledRound
from gspo_lightning.rollout.types import EpisodeCounts, Rollout


def sampled_round_state(sampled: SampledRound) -> dict[str, Any]:
    """``sampled`` as plain data (tensors on the CPU; timestamps are not kept: they mean nothing after a restart)."""
    rollout = {f.name: _plain(getattr(sampled.rollout, f.name)) for f in fields(Rollout)}
    return {"round_index": sampled.round_index, "version": sampled.version, "rollout": rollout,
            "seconds": dict(sampled.seconds)}  # fmt: skip


def restored_sampled_round(state: dict[str, Any]) -> SampledRound:
    values = dict(state["rollout"])
    if values.get("episodes") is not None:
        values["episodes"] = EpisodeCounts(**values["episodes"])
    return SampledRound(state["round_index"], state["version"], Rollout(**values), dict(state["seconds"]))


def _plain(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, EpisodeCounts):
        return {f.name: getattr(value, f.name).cpu() for f in fields(EpisodeCounts)}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value
