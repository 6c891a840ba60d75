"""``sampler.asynchronous``: how far sampling may run ahead of training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gspo_lightning.validation import SettingError

AsyncMode = Literal["off", "fixed_lag"]
ASYNC_MODES: tuple[str, ...] = ("off", "fixed_lag")
MAX_LAG = 64
"""More rounds ahead than this holds that many sampled rounds (and, for an engine of its own, weight snapshots)
in memory for no gain: staleness past a few versions only costs learning."""


@dataclass(frozen=True)
class AsyncRollouts:
    """Whether round r is sampled with the weights of round r, or of an earlier round, while training runs.

    Args:
        mode: ``off`` (default): on-policy rounds, sampled with the weights they are trained from. ``fixed_lag``:
            round r is sampled with the weights as they were at the start of round r - ``lag`` (the initial ones
            for the first ``lag`` rounds), so an engine of its own (``gspo_lightning.engines.VLLMProcessEngine``)
            samples round r + ``lag`` while round r trains. The schedule is fixed, so a run is reproducible and
            resumes exactly; sampled rounds not yet trained travel with the checkpoint. The objective's pi_old is
            then the proximal policy, the weights at the start of the round a sample is trained in (recomputed,
            ``sampler.old_logprobs: recompute``); the engine's log-probs are the behaviour policy's, and
            ``model.rollout_correction`` corrects the gap between the two.
        lag: rounds (policy versions) between the weights that sample a round and the weights that train on it,
            >= 1 with ``fixed_lag`` (1: one-step off-policy, sampling overlaps one round of training).
    """

    mode: str = "off"  # checked below (a Literal nested in an optional dataclass gets no readable CLI error)
    lag: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ASYNC_MODES:
            raise SettingError(f"sampler.asynchronous.mode must be one of {list(ASYNC_MODES)}, got {self.mode!r}")
        if isinstance(self.lag, bool) or not isinstance(self.lag, int) or not 1 <= self.lag <= MAX_LAG:
            raise SettingError(
                f"sampler.asynchronous.lag must be an integer in [1, {MAX_LAG}] (rounds between the weights that "
                f"sample a round and those that train on it), got {self.lag!r}"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def rounds_ahead(self) -> int:
        """How many rounds past the one training may be sampled already (0 when off)."""
        return self.lag if self.enabled else 0
