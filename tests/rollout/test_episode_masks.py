"""Only the policy's own tokens of an episode reach a loss: garbage stored at the tool / template positions between
its turns (and at padding) leaves every objective's loss and gradient bitwise unchanged, with a KL penalty and with
each rollout correction too. Walks the objective registry, so a new objective is covered without new code."""

import pytest
import torch

from gspo_lightning.episodes import EpisodeSettings, calculator
from gspo_lightning.module import GSPOModule
from gspo_lightning.objectives import OBJECTIVES, ObjectiveSpec, RolloutCorrection
from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.rollout.pipeline import Scoring
from gspo_lightning.rollout.round import RoundModel, RoundSettings, run_round
from gspo_lightning.rollout.types import PromptBatch
from tests.episodes.scripted import ScriptedEngine, calculator_policy, tool_loader

BATCH = PromptBatch([[{"role": "user", "content": "12*34"}], [{"role": "user", "content": "5+67"}]],
                    {"answer": ["408", "72"]})  # fmt: skip


def _module(objective, correction="off", kl_coef=0.0):
    spec = ObjectiveSpec(objective, kl_coef=kl_coef, kl_estimator="k3")
    module = GSPOModule(tool_loader(), objective=spec, rollout_correction=RolloutCorrection(correction, 2.0),
                        max_new_tokens=96, log_entropy=False)  # fmt: skip
    module.configure_model()
    module.on_fit_start()
    module.log = lambda *args, **kwargs: None
    return module


def _episode_minibatch(module, per_token: bool):
    settings = RoundSettings(group_size=2, num_minibatches=1, scoring=Scoring([ExactAnswer()], [1.0]),
                             episodes=EpisodeSettings(tools=[calculator]))  # fmt: skip
    model = RoundModel(module.policy, module.tokenizer, max_new_tokens=96, engine_logprobs=True,
                       reference=module.reference_policy)  # fmt: skip
    minibatch = run_round(ScriptedEngine(calculator_policy), model, settings, BATCH, seed=0).minibatches[0]
    generator = torch.Generator().manual_seed(0)
    policy = minibatch.response_mask.bool()  # [n, R]
    # off-policy and with varied advantages, so that ratios clip and the gradients are not trivial
    minibatch.old_logprobs = minibatch.old_logprobs + 1e-3 * torch.randn(policy.shape, generator=generator)
    minibatch.engine_logprobs = minibatch.old_logprobs + 0.5 * torch.randn(policy.shape, generator=generator)
    n = len(minibatch)
    minibatch.advantages = (torch.randn(policy.shape, generator=generator) if per_token
                            else torch.linspace(-1.0, 1.0, n))  # fmt: skip
    return minibatch


def _loss_and_gradients(module, minibatch):
    module.policy.zero_grad(set_to_none=True)
    batch = PromptBatch(BATCH.prompts, BATCH.columns, minibatch=minibatch)
    loss = module.training_step(batch, 0)
    loss.backward()
    return loss.detach().clone(), {name: p.grad.clone() for name, p in module.policy.named_parameters()}


def _garbage_between_turns(minibatch, generator):
    """The same minibatch with garbage (huge, NaN, inf) wherever the policy did not write the token."""
    elsewhere = ~minibatch.response_mask.bool()  # [n, R]: tool results, template tokens, padding
    context = elsewhere & minibatch.attention_mask[:, -elsewhere.shape[1]:].bool()
    assert context.any(), "the episodes must have tokens between turns"
    noise = 1e4 * torch.randn(elsewhere.shape, generator=generator)
    noise[::2, ::3] = float("nan")
    noise[1::2, ::4] = float("inf")

    def spoiled(values):
        return None if values is None else torch.where(elsewhere, noise, values)

    from dataclasses import replace

    advantages = spoiled(minibatch.advantages) if minibatch.advantages.dim() == 2 else minibatch.advantages
    return replace(minibatch, old_logprobs=spoiled(minibatch.old_logprobs), advantages=advantages,
                   engine_logprobs=spoiled(minibatch.engine_logprobs), ref_logprobs=spoiled(minibatch.ref_logprobs))  # fmt: skip


CASES = [(name, "off", 0.0) for name in sorted(OBJECTIVES)]
CASES += [("gspo", mode, 0.0) for mode in ("tis", "mis", "token_mask")] + [("gspo_token", "tis", 0.0)]
CASES += [("gspo", "off", 0.1), ("grpo", "off", 0.1)]


@pytest.mark.parametrize(("objective", "correction", "kl_coef"), CASES)
def test_garbage_at_context_positions_changes_no_loss_and_no_gradient(objective, correction, kl_coef):
    module = _module(objective, correction, kl_coef)
    per_token = OBJECTIVES[objective].per_token_advantages
    minibatch = _episode_minibatch(module, per_token)
    loss, gradients = _loss_and_gradients(module, minibatch)
    assert torch.isfinite(loss) and any(g.abs().sum() > 0 for g in gradients.values())
    spoiled_loss, spoiled_gradients = _loss_and_gradients(module, _garbage_between_turns(minibatch, torch.Generator()))
    assert torch.equal(loss, spoiled_loss)
    for name, gradient in gradients.items():
        assert torch.equal(gradient, spoiled_gradients[name]), name
    # the comparison can fail: the same change at the policy's own tokens moves the loss or a gradient
    moved_loss, moved_gradients = _loss_and_gradients(module, _moved_policy_tokens(minibatch))
    assert not torch.equal(loss, moved_loss) or any(
        not torch.equal(gradient, moved_gradients[name]) for name, gradient in gradients.items()
    )


def _moved_policy_tokens(minibatch):
    from dataclasses import replace

    policy = minibatch.response_mask.bool()
    shift = torch.where(policy, 0.01, 0.0)  # [n, R]
    engine = None if minibatch.engine_logprobs is None else minibatch.engine_logprobs - shift
    return replace(minibatch, old_logprobs=minibatch.old_logprobs + shift, engine_logprobs=engine)
