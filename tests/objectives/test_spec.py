"""ObjectiveSpec: a registered name, its options and a KL penalty, validated once when it is built."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gspo_lightning.objectives import (
    OBJECTIVE_PRESETS,
    OBJECTIVES,
    ObjectiveSpec,
    dr_grpo_loss,
    gspo_loss,
    gspo_token_loss,
    objective_loss,
    resolve_objective,
)
from tests.objectives.helpers import random_batch


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_registered_objective_is_a_preset_that_dispatches_to_its_loss(name: str) -> None:
    spec = resolve_objective(name)
    assert spec == OBJECTIVE_PRESETS[name] == ObjectiveSpec(name)
    assert spec.kl_coef == 0.0 and spec.kl_estimator == "k3" and spec.options == {}
    logprobs, old, advantages, mask = random_batch(7, [5, 0, 3, 2, 5], 0.3)
    loss, stats = objective_loss(spec, logprobs, old, advantages, mask, 0.2, 0.27)
    expected, expected_stats = OBJECTIVES[name].loss(logprobs, old, advantages, mask, 0.2, 0.27)
    assert torch.equal(loss, expected) and stats.keys() == expected_stats.keys()
    assert all(torch.equal(value, expected_stats[key]) for key, value in stats.items())


def test_the_registry_holds_the_eight_objectives() -> None:
    assert set(OBJECTIVES) == {"gspo", "gspo_token", "grpo", "dapo", "dr_grpo", "cispo", "gmpo", "sapo"}


def test_options_reach_the_loss() -> None:
    logprobs, old, advantages, mask = random_batch(7, [5, 0, 3], 0.3)
    spec = ObjectiveSpec("dr_grpo", options={"max_tokens": 12})
    loss, _ = objective_loss(spec, logprobs, old, advantages, mask, 0.2, 0.27)
    assert torch.equal(loss, dr_grpo_loss(logprobs, old, advantages, mask, 0.2, 0.27, max_tokens=12)[0])
    clamped = ObjectiveSpec("gspo", options={"max_log_ratio": 0.01})
    loss, _ = objective_loss(clamped, logprobs, old, advantages, mask, 0.2, 0.27)
    assert torch.equal(loss, gspo_loss(logprobs, old, advantages, mask, 0.2, 0.27, max_log_ratio=0.01)[0])


def test_gspo_token_spec_takes_per_token_advantages() -> None:
    logprobs, old, advantages, mask = random_batch(7, [5, 0, 3], 0.3, per_token_advantages=True)
    loss, _ = objective_loss(resolve_objective("gspo_token"), logprobs, old, advantages, mask, 0.2, 0.27)
    assert torch.equal(loss, gspo_token_loss(logprobs, old, advantages, mask, 0.2, 0.27)[0])


def test_a_spec_resolves_to_itself_and_specs_are_frozen() -> None:
    spec = ObjectiveSpec("grpo", kl_coef=0.01, kl_estimator="k1", kl_in="reward")
    assert resolve_objective(spec) is spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.kl_coef = 0.1  # type: ignore[misc]


def test_unknown_name_lists_the_allowed_names() -> None:
    allowed = r"allowed names: cispo, dapo, dr_grpo, gmpo, grpo, gspo, gspo_token, sapo"
    with pytest.raises(ValueError, match=rf"unknown objective 'ppo'; {allowed}"):
        resolve_objective("ppo")
    with pytest.raises(ValueError, match=rf"unknown objective 'ppo'; {allowed}"):
        ObjectiveSpec("ppo")
    with pytest.raises(TypeError, match=r"objective name or an ObjectiveSpec"):
        resolve_objective(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kl_coef": -0.1}, r"kl_coef must be a finite number >= 0"),
        ({"kl_coef": float("nan")}, r"kl_coef must be a finite number >= 0"),
        ({"kl_coef": float("inf")}, r"kl_coef must be a finite number >= 0"),
        ({"kl_estimator": "k4"}, r"kl_estimator must be one of k1, k2, k3, got kl_estimator='k4'"),
        ({"kl_coef": 0.1, "kl_estimator": "k1"}, r"expected gradient of 0 .* use kl_estimator one of k2, k3"),
        ({"kl_in": "advantage"}, r"kl_in must be one of loss, reward, got kl_in='advantage'"),
        ({"name": "dr_grpo", "options": {"max_tokens": 0}}, r"max_tokens must be an integer >= 1"),
        ({"name": "dr_grpo", "options": {"max_tokens": -5}}, r"max_tokens must be an integer >= 1"),
        ({"name": "grpo", "options": {"max_tokens": 512}}, r"objective 'grpo' has no option\(s\) \['max_tokens'\]; its options: none"),
        ({"name": "sapo", "options": {"tau": 1.0}}, r"no option\(s\) \['tau'\]; its options: tau_neg, tau_pos"),
    ],
)  # fmt: skip
def test_invalid_fields_are_rejected(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ObjectiveSpec(**fields)
