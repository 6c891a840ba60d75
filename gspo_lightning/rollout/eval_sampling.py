"""Helpers of the held-out evaluation: its settings' checks, isolated seeded randomness, counting solved samples.

No Lightning here: pure functions and a context manager, testable on their own.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gspo_lightning.rollout.prompts import PROMPT_OVERFLOWS
from gspo_lightning.validation import require


def validate_evaluation(
    every_n_steps: int,
    max_new_tokens: int,
    prompt_overflow: str,
    samples_per_prompt: int,
    temperature: float,
    top_p: float,
    top_k: int,
    pass_k: Sequence[int],
    solved_at: float,
    seed: int,
) -> None:
    """Every ``evaluation.*`` setting, checked before any model is built; each message names the setting."""
    require(every_n_steps >= 0, f"evaluation.every_n_steps must be >= 0 (0 disables it), got {every_n_steps}")
    require(max_new_tokens >= 1, f"evaluation.max_new_tokens must be >= 1, got {max_new_tokens}")
    require(
        prompt_overflow in PROMPT_OVERFLOWS,
        f"evaluation.prompt_overflow must be one of {list(PROMPT_OVERFLOWS)}, got {prompt_overflow!r}",
    )
    require(
        samples_per_prompt >= 1,
        f"evaluation.samples_per_prompt must be >= 1 (1: one greedy decode per prompt), got {samples_per_prompt}",
    )
    require(
        temperature > 0,
        f"evaluation.temperature must be > 0 (it applies when samples_per_prompt > 1), got {temperature}",
    )
    require(0 < top_p <= 1, f"evaluation.top_p must be in (0, 1], got {top_p}")
    require(top_k >= 0, f"evaluation.top_k must be >= 0 (0 disables it), got {top_k}")
    ks = list(pass_k)
    require(len(ks) > 0, "evaluation.pass_k must name at least one k (e.g. [1])")
    in_range = all(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= samples_per_prompt for k in ks)
    require(
        in_range,
        f"evaluation.pass_k entries must be between 1 and evaluation.samples_per_prompt={samples_per_prompt}, "
        f"got {ks}: the unbiased pass@k estimate needs at least k samples per prompt (raise samples_per_prompt)",
    )
    require(len(set(ks)) == len(ks), f"evaluation.pass_k entries must be distinct, got {ks}")
    number = isinstance(solved_at, int | float) and not isinstance(solved_at, bool)
    require(
        number and math.isfinite(solved_at),
        f"evaluation.solved_at must be a finite number (a sample is solved when its score >= it), got {solved_at!r}",
    )
    require(
        isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0,
        f"evaluation.seed must be an integer >= 0, got {seed!r}",
    )


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


def metric_device(device: torch.device) -> torch.device:
    """Where the float64 pass@k states live: the module's device (DDP reduces there), except MPS (no float64)."""
    return torch.device("cpu") if device.type == "mps" else device


def count_solved(scores: Tensor, samples_per_prompt: int, solved_at: float) -> Tensor:
    """How many of each prompt's samples scored >= ``solved_at``.

    Args:
        scores: [P * n] scores, prompt-major (prompt i's samples at rows i*n .. i*n + n - 1).
        samples_per_prompt: n.
        solved_at: the score from which a sample counts as solved.

    Returns:
        [P] int64.
    """
    solved = scores >= solved_at  # [P * n] bool; NaN counts as unsolved
    return solved.view(-1, samples_per_prompt).sum(-1)  # [P]
