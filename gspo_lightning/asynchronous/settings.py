"""``sampler.asynchronous``: how far sampling may run ahead of training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gspo_lightning.validation import SettingError, require_one_of

AsyncMode = Literal["off", "fixed_lag", "streaming"]
ASYNC_MODES: tuple[str, ...] = ("off", "fixed_lag", "streaming")
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
            ``streaming``: generation never waits for training (``asynchronous/streaming.py``): prompt groups are
            generated in chunks of ``chunk_tokens`` on an engine of its own, the newest weights loaded between
            chunks (a sample in flight continues under them; every token records its version), and a group is
            admitted only while no token of it can be more than ``max_staleness`` versions old when trained.
        lag: rounds (policy versions) between the weights that sample a round and the weights that train on it,
            >= 1 with ``fixed_lag`` (1: one-step off-policy, sampling overlaps one round of training).
        max_staleness: ``streaming``: the most versions any trained token may be older than the proximal policy
            (>= 0; 0 is on-policy).
        chunk_tokens: ``streaming``: tokens generated per sample between two chances to load new weights (>= 1).
    """

    mode: str | bool = "off"  # checked below (a Literal nested in an optional dataclass gets no readable CLI error)
    lag: int = 1
    max_staleness: int = 2
    chunk_tokens: int = 32

    def __post_init__(self) -> None:
        if self.mode is False:  # YAML reads an unquoted off as false
            object.__setattr__(self, "mode", "off")
        require_one_of("sampler.asynchronous.mode", self.mode, ASYNC_MODES)
        if isinstance(self.lag, bool) or not isinstance(self.lag, int) or not 1 <= self.lag <= MAX_LAG:
            raise SettingError(
                f"sampler.asynchronous.lag must be an integer in [1, {MAX_LAG}] (rounds between the weights that "
                f"sample a round and those that train on it), got {self.lag!r}"
            )

        for name, (low, high) in {"max_staleness": (0, MAX_LAG), "chunk_tokens": (1, 1 << 20)}.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise SettingError(f"sampler.asynchronous.{name} must be an integer in [{low}, {high}], got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def bound_setting(self) -> str:
        """The setting, as a user writes it, that bounds how old a trained sample may be (``rounds_ahead``)."""
        return "sampler.asynchronous." + ("max_staleness" if self.mode == "streaming" else "lag")

    @property
    def rounds_ahead(self) -> int:
        """How many versions old a trained sample may be (0 when off): the lag, or the streaming bound."""
        if self.mode == "streaming":
            return self.max_staleness
        return self.lag if self.enabled else 0
