"""``sampler.asynchronous``: the bound a resumed run may not change is named as the user wrote it."""

from __future__ import annotations

import pytest

from gspo_lightning.asynchronous.settings import AsyncRollouts
from gspo_lightning.engines import VLLMProcessEngine
from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.sampling import GroupSampler
from gspo_lightning.validation import SettingError


def sampler(**asynchronous) -> GroupSampler:
    # VLLMProcessEngine starts nothing until setup: building the callback is cheap
    settings = AsyncRollouts(**asynchronous)
    return GroupSampler(rewards=[ExactAnswer()], engine=VLLMProcessEngine(), asynchronous=settings)


@pytest.mark.parametrize(
    ("saved", "now", "named"),
    [
        ({"mode": "streaming", "max_staleness": 2}, {"mode": "streaming", "max_staleness": 4},
         r"sampler.asynchronous.max_staleness \(checkpoint 2, now 4\)"),
        ({"mode": "fixed_lag", "lag": 1}, {"mode": "fixed_lag", "lag": 3},
         r"sampler.asynchronous.lag \(checkpoint 1, now 3\)"),
    ],
)  # fmt: skip
def test_a_changed_bound_is_refused_on_resume_naming_its_own_setting(saved, now, named):
    checkpoint = sampler(**saved).state_dict()
    with pytest.raises(SettingError, match=named):
        sampler(**now).load_state_dict(checkpoint)


def test_the_setting_a_mode_does_not_read_may_change_on_resume():
    sampler(mode="fixed_lag", lag=2, max_staleness=9).load_state_dict(
        sampler(mode="fixed_lag", lag=2, max_staleness=0).state_dict()
    )
    sampler(mode="streaming", lag=5).load_state_dict(sampler(mode="streaming", lag=1).state_dict())
