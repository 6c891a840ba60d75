"""The sampler callback in a LightningModule that is not ours: only the documented contract is used."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from gspo_lightning.engines import HFEngine
from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.micro_batches import BatchLayout
from gspo_lightning.objectives import RolloutCorrection
from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.rollout import PromptBatch
from gspo_lightning.sampling import GroupSampler
from gspo_lightning.rollout.pipeline import encode_prompts


class ReinforceModule(pl.LightningModule):
    """Someone else's module: plain REINFORCE with the group baseline, with the sampler's contract
    (``SamplerModule``): its own parts, and the neutral value of each feature it does not use."""

    def __init__(self, policy, tokenizer, max_new_tokens: int = 4, temperature: float = 1.0):
        super().__init__()
        self.policy = policy
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.reference_policy = None
        self.kl_reward_penalty = None
        self.routing_replay = "off"
        self.rollout_correction = RolloutCorrection()
        self.needs_engine_logprobs = False
        self.per_token_advantages = False
        self.policy_loader = None
        self.logprob_chunk_size = 0
        self.batch_layout = BatchLayout()
        self.seen: list[tuple[int, int, int]] = []

    def training_step(self, batch, batch_idx):
        mb = batch.minibatch
        logprobs = response_logprobs(self.policy, mb.input_ids, mb.attention_mask, mb.response_ids.shape[1])
        mask = mb.response_mask.float()
        self.seen.append((batch.rollout_index, batch.minibatch_index, len(mb)))
        return -(mb.advantages[:, None] * logprobs * mask).sum() / mask.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.policy.parameters(), lr=1e-2)


def _prompt_batches(rounds: int, k: int) -> list[PromptBatch]:
    prompts, answers = ["1+1=", "2+3="], ["2", "5"]
    return [
        PromptBatch(prompts, {"answer": answers}, rollout_index=r, minibatch_index=i, num_minibatches=k)
        for r in range(rounds)
        for i in range(k)
    ]


def _trainer(sampler: GroupSampler, steps: int) -> pl.Trainer:
    return pl.Trainer(
        max_steps=steps, accelerator="cpu", callbacks=[sampler], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )


def test_sampler_drives_a_foreign_module(policy, tokenizer):
    module = ReinforceModule(policy, tokenizer)
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=4, num_minibatches=2)
    calls = []
    original = policy.generate
    policy.generate = lambda *a, **k: calls.append(1) or original(*a, **k)
    loader = DataLoader(_prompt_batches(3, 2), batch_size=None, collate_fn=lambda b: b)
    _trainer(sampler, 6).fit(module, loader)
    assert module.seen == [(r, i, 4) for r in range(3) for i in range(2)]  # 2 prompts x 4 responses / 2
    assert len(calls) == 3  # one sampling pass per rollout round, not per step
    metrics = _trainer_metrics(module)
    for key in ("rollout/reward_mean", "rollout/zero_variance_frac", "rollout/truncated_frac", "time/generate_s"):
        assert key in metrics


def _trainer_metrics(module):
    return module.trainer.callback_metrics


def test_sampler_state_carries_a_partly_consumed_round(policy, tokenizer):
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=2, num_minibatches=2)
    module = ReinforceModule(policy, tokenizer, max_new_tokens=3)
    loader = DataLoader(_prompt_batches(1, 2)[:1], batch_size=None, collate_fn=lambda b: b)
    _trainer(sampler, 1).fit(module, loader)
    restored = GroupSampler(rewards=[ExactAnswer()], group_size=2, num_minibatches=2)
    restored.load_state_dict(sampler.state_dict())
    assert restored._rollout_index == 0
    for saved, loaded in zip(sampler._minibatches, restored._minibatches):
        assert torch.equal(saved.old_logprobs, loaded.old_logprobs)


def test_sampler_rejects_a_module_without_the_contract(policy, tokenizer):
    module = ReinforceModule(policy, tokenizer)
    del module.routing_replay, module.logprob_chunk_size
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=2, num_minibatches=2)
    loader = DataLoader(_prompt_batches(1, 2), batch_size=None, collate_fn=lambda b: b)
    with pytest.raises(ValueError, match=r"\(ReinforceModule\) to have routing_replay, logprob_chunk_size: see"):
        _trainer(sampler, 1).fit(module, loader)
    module = ReinforceModule(policy, tokenizer)
    module.tokenizer = None
    with pytest.raises(ValueError, match="needs the LightningModule's tokenizer by the time training starts"):
        _trainer(sampler, 1).fit(module, loader)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"group_size": 1}, "group_size must be >= 2"),
        ({"top_p": 0.95}, r"sampler.top_p must be 1.0 \(no nucleus truncation\), got 0.95: the log-probs"),
        ({"top_k": 20}, r"sampler.top_k must be 0 \(no top-k truncation\), got 20"),
        ({"reward_weights": [1.0, 2.0]}, "reward_weights has 2 values for 1 rewards"),
    ],
)
def test_sampler_settings_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GroupSampler(rewards=[ExactAnswer()], **kwargs)


@pytest.mark.parametrize("old_logprobs", ["recompute", "engine"])
def test_sharing_the_prompt_prefill_draws_the_same_rollout(policy, tokenizer, old_logprobs):
    module = ReinforceModule(policy, tokenizer, max_new_tokens=5)
    prompts, columns = ["1+1=", "12+34=", "5"], {"answer": ["2", "46", "5"]}
    rollouts, caches = [], []
    original = policy.generate
    policy.generate = lambda **k: caches.append(k.get("cache", k.get("past_key_values"))) or original(**k)
    for share in (False, True):
        sampler = GroupSampler(
            rewards=[ExactAnswer()],
            group_size=4,
            old_logprobs=old_logprobs,
            engine=HFEngine(share_prompt_prefill=share),
        )
        torch.manual_seed(0)
        rollouts.append(sampler.sample(module, prompts, columns))
    plain, shared = rollouts
    assert caches[0] is None and caches[1] is not None  # only the second sampler took the shared path
    prompt_ids, _ = encode_prompts(tokenizer, prompts, "cpu")  # [3, 6]
    assert torch.equal(shared.prompt_ids, prompt_ids.repeat_interleave(4, dim=0))  # row i*G + g: prompt i
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "prompt_cut"):
        assert torch.equal(getattr(shared, name), getattr(plain, name)), name
    assert shared.completions == plain.completions
    if old_logprobs == "engine":
        mask = shared.response_mask.bool()
        torch.testing.assert_close(shared.engine_logprobs[mask], plain.engine_logprobs[mask], rtol=0, atol=1e-5)


def test_a_kl_reward_penalty_is_subtracted_before_the_advantages(policy, tokenizer):
    import copy

    from gspo_lightning.objectives import KLRewardPenalty, group_advantages

    module = ReinforceModule(policy, tokenizer)
    module.reference_policy = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        for parameter in module.reference_policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))  # a reference that differs from pi_old
    module.kl_reward_penalty = KLRewardPenalty(coef=0.5, estimator="k1")
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=4, num_minibatches=2)
    loader = DataLoader(_prompt_batches(1, 2)[:1], batch_size=None, collate_fn=lambda b: b)
    _trainer(sampler, 1).fit(module, loader)
    mbs = sampler._minibatches
    kl = torch.cat([((mb.old_logprobs - mb.ref_logprobs) * mb.response_mask).sum(-1) for mb in mbs])  # [N]
    rewards = torch.cat([mb.rewards for mb in mbs])  # [N] as scored, before the penalty
    expected = group_advantages(rewards - 0.5 * kl, 4, "group")
    torch.testing.assert_close(torch.cat([mb.advantages for mb in mbs]), expected, rtol=1e-5, atol=1e-6)
    assert kl.abs().max() > 1e-3  # the penalty did change the advantages
    torch.testing.assert_close(module.trainer.callback_metrics["rollout/kl_penalty_mean"], kl.mean())


def test_the_samples_come_at_the_modules_temperature_and_budget(policy, tokenizer):
    """One setting each: the module's temperature and response budget are what the engine samples with."""
    module = ReinforceModule(policy, tokenizer, max_new_tokens=3, temperature=0.7)
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=2, num_minibatches=1)
    asked = []
    original = sampler.engine.sample
    sampler.engine.sample = lambda *args, **kwargs: asked.append(args[4]) or original(*args, **kwargs)
    loader = DataLoader(_prompt_batches(1, 1), batch_size=None, collate_fn=lambda b: b)
    _trainer(sampler, 1).fit(module, loader)
    assert [(s.temperature, s.max_new_tokens, s.top_p, s.top_k) for s in asked] == [(0.7, 3, 1.0, 0)]
    assert sampler.last_rollout.response_ids.shape[1] <= 3
