"""Saving and restoring every random generator sampling draws from, for exact resume."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_states() -> dict[str, Any]:
    """The global Python, NumPy, torch CPU and (when present) CUDA generator states."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
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
