"""Every registered objective, end to end: its loop-by-loop reference against the vectorised loss (value and
gradient), a training step through GSPOModule (with the chunked head's prediction where it is separable), its
preset through the CLI, and a row in the README's objective table. A new objective file is covered unchanged."""

from __future__ import annotations

import re

import pytest
import torch

from gspo_lightning.cli import main
from gspo_lightning.objectives import OBJECTIVES, ObjectiveSpec, objective_loss
from tests.objectives.helpers import random_batch
from tests.test_cli import ROOT

NAMES = sorted(OBJECTIVES)


def _off_policy_batch(objective, per_token: bool):
    """A padded batch (huge values and NaN on padding) with ratios spread around 1 across the clip range."""
    low, high = objective.clip_range
    spread = 3 * max(low, high, 0.05)  # some tokens and responses inside the range, some outside
    return random_batch(11, [6, 1, 0, 4, 6, 3], spread, per_token_advantages=per_token)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("per_token", [False, True])
def test_the_vectorised_loss_equals_the_loop_by_loop_reference(name, per_token):
    objective = OBJECTIVES[name]
    if per_token and not objective.per_token_advantages:
        pytest.skip(f"{name} takes one advantage per response")
    logprobs, old, advantages, mask = _off_policy_batch(objective, per_token)
    eps = objective.clip_range
    loss, stats = objective.loss(logprobs, old, advantages, mask, *eps)
    (grad,) = torch.autograd.grad(loss, logprobs)
    reference = logprobs.detach().double().requires_grad_()
    expected, _ = objective.reference_loss(reference, old.double(), advantages.double(), mask, *eps)
    (expected_grad,) = torch.autograd.grad(expected, reference)
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-4, atol=1e-6)
    assert torch.isfinite(grad).all() and (grad[~mask] == 0).all()  # padding: no value, no gradient
    assert "clip_frac" in stats and all(value.dtype == torch.float32 and value.dim() == 0 for value in stats.values())


@pytest.mark.parametrize("name", NAMES)
def test_on_policy_the_gradient_is_the_policy_gradient_weighted_as_the_objective_aggregates(name):
    """At pi_theta = pi_old every objective's gradient is sum over tokens of w_t A grad log pi, with the weights of
    its aggregation: the ratios are 1 and no clip or gate acts."""
    objective = OBJECTIVES[name]
    logprobs, old, advantages, mask = random_batch(5, [4, 2, 3], 0.0)
    loss, stats = objective.loss(logprobs, old, advantages, mask, *objective.clip_range)
    (grad,) = torch.autograd.grad(loss, logprobs)
    lengths = mask.sum(-1, keepdim=True).float()  # [N, 1]
    weights = {
        "sequence_mean": 1.0 / (lengths * len(lengths)),
        "token_mean": torch.full_like(lengths, 1.0 / float(mask.sum())),
        "constant": torch.full_like(lengths, 1.0 / (len(lengths) * mask.shape[1])),
    }[objective.aggregation]
    expected = torch.where(mask, -advantages[:, None] * weights, 0.0)  # [N, T]
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
    assert stats["clip_frac"] == 0


@pytest.mark.parametrize("name", NAMES)
def test_a_training_step_through_the_module(name, monkeypatch):
    from gspo_lightning import chunked_logprobs
    from tests.test_module import _off_policy_gradients

    recomputed = []
    real = chunked_logprobs._recomputed_grads
    monkeypatch.setattr(chunked_logprobs, "_recomputed_grads", lambda *a: recomputed.append(1) or real(*a))
    naive, _ = _off_policy_gradients(0, name)
    chunked, logged = _off_policy_gradients(1024, name)
    for parameter, gradient in naive.items():
        torch.testing.assert_close(chunked[parameter], gradient, atol=1e-6, rtol=1e-4, msg=parameter)
    assert any(gradient.abs().sum() > 0 for gradient in chunked.values())
    assert (recomputed == []) == OBJECTIVES[name].separable  # predicted in forward exactly when separable
    assert "train/clip_frac" in logged


@pytest.mark.parametrize("name", NAMES)
def test_the_preset_runs_through_the_cli(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = main(["-c", str(ROOT / "configs/quickstart.yaml"), f"--model.init_args.objective={name}"], run=False)
    assert cli.model.objective == ObjectiveSpec(name) or cli.model.objective.name == name
    assert (cli.model.eps_low, cli.model.eps_high) == OBJECTIVES[name].clip_range


def test_the_docs_list_every_registered_objective():
    readme = (ROOT / "docs" / "objectives.md").read_text()
    table = readme[readme.index("| objective | ratio |") :]
    table = table[: table.index("\n\n")]  # the objective table, up to its first blank line
    listed = set(re.findall(r"^\| `([a-z_]+)`", table, flags=re.M))
    assert listed == set(OBJECTIVES), f"docs/objectives.md objective table: {sorted(listed)}, registry: {sorted(OBJECTIVES)}"


def test_a_kl_penalty_aggregates_as_each_objective_does():
    logprobs, old, advantages, mask = random_batch(3, [5, 2, 4], 0.1)
    ref = old - 0.2
    for name in NAMES:
        spec = ObjectiveSpec(name, kl_coef=0.5, kl_estimator="k2")
        with_kl, stats = objective_loss(spec, logprobs, old, advantages, mask, *OBJECTIVES[name].clip_range, ref)
        without, _ = objective_loss(ObjectiveSpec(name), logprobs, old, advantages, mask, *OBJECTIVES[name].clip_range)
        torch.testing.assert_close(with_kl, without + 0.5 * stats["kl"])
