"""What exact resume needs of the rollout's randomness and of each rank's share of it.

- Every random generator sampling draws from, saved with the checkpoint and put back (``rng_states``).
- Seeds that are a function of (seed, step or round, rank) alone, so a resumed run redraws the same samples, and
  a context that seeds sampling without disturbing the training run's own random stream (``isolated_rng``).
- Callback state that differs per rank (each rank samples its own prompts), in a checkpoint written by rank 0.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gspo_lightning.rollout.types import Minibatch
from gspo_lightning.validation import SettingError


def rng_states() -> dict[str, Any]:
    """The global Python, NumPy, torch CPU and (when present) CUDA generator states."""
    states: dict[str, Any] = {"python": random.getstate(), "numpy": _numpy_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states

def restore_rng_states(states: dict[str, Any]) -> None:
    """Put back what ``rng_states`` returned (a CUDA state is skipped on a machine without CUDA)."""
    random.setstate(states["python"])
    name, keys, position, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])

def _numpy_state() -> tuple[str, torch.Tensor, int, int, float]:
    # A tensor instead of an ndarray: checkpoints are loaded with torch.load(weights_only=True).
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return name, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached_gaussian)


def evaluation_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed determined by (seed, global step, rank) alone, so a resumed run redraws the same samples.

    The rank is mixed in so that ranks evaluating different prompts do not share one random stream;
    ``SeedSequence`` keeps nearby triples (seed 0 step 1, seed 1 step 0) far apart.
    """
    state = np.random.SeedSequence([seed, step, rank]).generate_state(1, dtype=np.uint64)
    return int(state[0]) >> 1

@contextlib.contextmanager
def isolated_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Seed the generators sampling (and user reward code) may draw from, and put every one back afterwards.

    Torch's CPU generator and ``device``'s generator are forked with ``torch.random.fork_rng``; Python's and
    NumPy's global generators are saved and restored by hand. The training run's random stream, which exact
    resume replays, is left exactly as it was.
    """
    accelerator = device.type != "cpu"
    module: Any = torch.get_device_module(device.type) if accelerator else None
    index = 0
    if accelerator:
        index = device.index if device.index is not None else getattr(module, "current_device", lambda: 0)()
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[index] if accelerator else [], device_type=device.type):
            torch.default_generator.manual_seed(seed)
            if accelerator:
                # manual_seed seeds the current device; make it the evaluated one (a process may see several).
                selected = module.device(index) if hasattr(module, "device") else contextlib.nullcontext()
                with selected:
                    module.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


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


def round_checkpoint(
    rollout_index: int | None, minibatches: list[Minibatch], stats: dict[str, torch.Tensor], fixed: dict[str, Any],
    sampled_ahead: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A sampler's checkpoint: every rank's partly consumed round, the rounds it sampled ahead (asynchronous
    rollouts), its random state, and the settings it fixes."""
    local = {
        "rollout_index": rollout_index,
        "minibatches": [{k: v.cpu() for k, v in mb.tensors().items()} for mb in minibatches],
        "stats": stats,
        "rng": rng_states(),
    }
    if sampled_ahead is not None:
        local["sampled_ahead"] = sampled_ahead
    return {"per_rank": gather_per_rank(local), "settings": fixed}


def restored_round(state_dict: dict[str, Any], fixed: dict[str, Any], owner: str) -> dict[str, Any]:
    """This rank's part of ``round_checkpoint``'s output, once the settings it fixed are checked unchanged."""
    saved = state_dict.get("settings", {})  # absent in checkpoints from before they were recorded
    changed = [f"{name} (checkpoint {saved[name]}, now {value})" for name, value in fixed.items()
               if name in saved and saved[name] != value]  # fmt: skip
    if changed:
        raise SettingError(f"cannot resume with a changed {', '.join(changed)}: start a new run to change it")
    return select_rank(state_dict["per_rank"], owner)
