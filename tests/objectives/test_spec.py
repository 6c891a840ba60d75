from __future__ import annotations

import dataclasses

import pytest
import torch

from gspo_lightning.objectives import (
    OBJECTIVE_PRESETS,
    ObjectiveSpec,
    dr_grpo_loss,
    grpo_loss,
    grpo_token_mean_loss,
    gspo_loss,
    gspo_token_loss,
    objective_loss,
    resolve_objective,
    validate_spec,
)
from tests.objectives.helpers import random_batch

EXPECTED_PRESETS = {
    "gspo": (ObjectiveSpec(ratio="sequence", aggregation="sequence_mean"), gspo_loss),
    "gspo_token": (ObjectiveSpec(ratio="sequence_token", aggregation="sequence_mean"), gspo_token_loss),
    "grpo": (ObjectiveSpec(ratio="token", aggregation="sequence_mean"), grpo_loss),
    "dapo": (ObjectiveSpec(ratio="token", aggregation="token_mean"), grpo_token_mean_loss),
    "dr_grpo": (ObjectiveSpec(ratio="token", aggregation="constant"), dr_grpo_loss),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_presets_resolve_and_dispatch_to_their_loss(name: str) -> None:
    spec, loss_fn = EXPECTED_PRESETS[name]
    assert resolve_objective(name) == spec and OBJECTIVE_PRESETS[name] == spec
    assert spec.kl_coef == 0.0 and spec.kl_estimator == "k3" and spec.max_tokens is None
    logprobs, old, advantages, mask = random_batch(7, [5, 0, 3, 2, 5], 0.3)
    loss, stats = objective_loss(spec, logprobs, old, advantages, mask, 0.2, 0.27)
    expected, expected_stats = loss_fn(logprobs, old, advantages, mask, 0.2, 0.27)
    assert torch.equal(loss, expected)
    assert stats.keys() == expected_stats.keys()
    assert all(torch.equal(value, expected_stats[name]) for name, value in stats.items())


def test_presets_are_exactly_the_five_objectives() -> None:
    assert set(OBJECTIVE_PRESETS) == set(EXPECTED_PRESETS)


def test_dr_grpo_max_tokens_reaches_the_loss() -> None:
    logprobs, old, advantages, mask = random_batch(7, [5, 0, 3], 0.3)
    spec = ObjectiveSpec(ratio="token", aggregation="constant", max_tokens=12)
    loss, _ = objective_loss(spec, logprobs, old, advantages, mask, 0.2, 0.27)
    assert torch.equal(loss, dr_grpo_loss(logprobs, old, advantages, mask, 0.2, 0.27, max_tokens=12)[0])


def test_gspo_token_spec_takes_per_token_advantages() -> None:
    logprobs, old, advantages, mask = random_batch(7, [5, 0, 3], 0.3, per_token_advantages=True)
    loss, _ = objective_loss(resolve_objective("gspo_token"), logprobs, old, advantages, mask, 0.2, 0.27)
    assert torch.equal(loss, gspo_token_loss(logprobs, old, advantages, mask, 0.2, 0.27)[0])


def test_a_spec_resolves_to_itself_and_specs_are_frozen() -> None:
    spec = ObjectiveSpec(ratio="token", kl_coef=0.01, kl_estimator="k1", kl_in="reward")
    assert resolve_objective(spec) is spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.kl_coef = 0.1  # type: ignore[misc]


def test_unknown_name_lists_the_allowed_names() -> None:
    allowed = r"allowed names: dapo, dr_grpo, grpo, gspo, gspo_token"
    with pytest.raises(ValueError, match=rf"unknown objective 'ppo'; {allowed}"):
        resolve_objective("ppo")
    with pytest.raises(TypeError, match=r"objective name or an ObjectiveSpec"):
        resolve_objective(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("ratio", ["sequence", "sequence_token"])
@pytest.mark.parametrize("aggregation", ["token_mean", "constant"])
def test_sequence_ratio_with_a_length_weighted_aggregation_is_rejected(ratio: str, aggregation: str) -> None:
    with pytest.raises(ValueError) as error:
        ObjectiveSpec(ratio=ratio, aggregation=aggregation)  # type: ignore[arg-type]
    message = str(error.value)
    assert "re-weights each response by its length" in message
    assert "Eqs. 5/7" in message and "1/G" in message
    assert "aggregation='sequence_mean'" in message and "ratio='token'" in message


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"ratio": "sequence", "kl_coef": -0.1}, r"kl_coef must be a finite number >= 0"),
        ({"ratio": "sequence", "kl_coef": float("nan")}, r"kl_coef must be a finite number >= 0"),
        ({"ratio": "sequence", "kl_coef": float("inf")}, r"kl_coef must be a finite number >= 0"),
        ({"ratio": "sequence", "kl_estimator": "k4"}, r"kl_estimator must be one of k1, k2, k3, got kl_estimator='k4'"),
        ({"ratio": "sequence", "kl_coef": 0.1, "kl_estimator": "k1"}, r"expected gradient of 0 .* use kl_estimator one of k2, k3"),
        ({"ratio": "sequence", "kl_in": "advantage"}, r"kl_in must be one of loss, reward, got kl_in='advantage'"),
        ({"ratio": "token", "aggregation": "constant", "max_tokens": 0}, r"max_tokens must be an integer >= 1"),
        ({"ratio": "token", "aggregation": "constant", "max_tokens": -5}, r"max_tokens must be an integer >= 1"),
        ({"ratio": "token", "max_tokens": 512}, r"max_tokens=512 only applies to aggregation='constant'"),
        ({"ratio": "tokens"}, r"ratio must be one of sequence, token, sequence_token, got ratio='tokens'"),
        ({"ratio": "token", "aggregation": "mean"}, r"aggregation must be one of sequence_mean, token_mean, constant"),
    ],
)
def test_invalid_fields_are_rejected(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ObjectiveSpec(**fields)


def test_validate_spec_catches_a_spec_changed_behind_the_dataclass() -> None:
    spec = ObjectiveSpec(ratio="sequence")
    object.__setattr__(spec, "aggregation", "token_mean")
    with pytest.raises(ValueError, match=r"length"):
        validate_spec(spec)
    logprobs, old, advantages, mask = random_batch(7, [2, 1], 0.3)
    with pytest.raises(ValueError, match=r"length"):
        objective_loss(spec, logprobs, old, advantages, mask, 0.2, 0.2)
