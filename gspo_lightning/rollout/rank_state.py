"""Callback state that differs per rank (each rank samples its own prompts) in a checkpoint written by rank 0."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    """This process' rank and the world size (0 and 1 outside torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_per_rank(local: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``local`` state, in rank order. Collective: all ranks call it (Lightning builds the
    checkpoint dict on every rank, then rank 0 writes it)."""
    _, world = rank_and_world()
    if world == 1:
        return [local]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local)
    return gathered


def select_rank(per_rank: list[dict[str, Any]], owner: str) -> dict[str, Any]:
    """This rank's entry of a ``gather_per_rank`` list; the world size must be the one that saved it."""
    rank, world = rank_and_world()
    if len(per_rank) != world:
        raise ValueError(
            f"{owner} state was saved by {len(per_rank)} rank(s) but the run resumes on {world}: an exact resume "
            "needs the same number of devices (or start a new run from the exported policy)"
        )
    return per_rank[rank]
