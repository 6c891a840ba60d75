"""The sampler under misbehaving rewards, overlong prompts and wrong setups: clear errors, or counted skips."""

from __future__ import annotations

import math
import time

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from gspo_lightning.data.formatting import PromptFormatter
from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.rollout.round import RoundModel
from gspo_lightning.sampling import GroupSampler
from gspo_lightning.rollout.stats import rollout_stats
from tests.rewards.reward_helpers import hanging_reward
from tests.rollout.test_sampler import ReinforceModule, _prompt_batches, _trainer

PROMPTS, COLUMNS = ["1+1=", "2+3="], {"answer": ["2", "5"]}


def _by_index_nan_at_1(prompts, completions, **columns):
    return [math.nan if i == 1 else float(i) for i in range(len(completions))]


def _caller(policy, tokenizer, max_new_tokens: int = 3):
    return RoundModel(policy, tokenizer, max_new_tokens=max_new_tokens)


def test_skip_mode_zeros_the_group_with_a_nan_and_counts_one(policy, tokenizer):
    sampler = GroupSampler(rewards=[_by_index_nan_at_1], group_size=2, num_minibatches=1, reward_errors="skip")
    rollout = sampler.sample(_caller(policy, tokenizer), PROMPTS, COLUMNS)
    assert rollout.advantages[:2].tolist() == [0.0, 0.0]  # the group holding the NaN: no signal
    assert rollout.advantages[2:].tolist() == pytest.approx([-0.7071, 0.7071], abs=1e-4)  # the other: intact
    stats = rollout_stats(rollout, 2)
    assert stats["reward_errors"] == 1 and stats["groups_skipped"] == 1 and stats["no_signal"] == 0


def test_raise_mode_stops_naming_the_function_and_sample(policy, tokenizer):
    sampler = GroupSampler(rewards=[_by_index_nan_at_1], group_size=2, num_minibatches=1)
    message = r"_by_index_nan_at_1 returned nan \(first offending sample 1: .*prompt '1\+1='"
    with pytest.raises(ValueError, match=message):
        sampler.sample(_caller(policy, tokenizer), PROMPTS, COLUMNS)


def test_a_hanging_reward_in_skip_mode_lets_training_continue(policy, tokenizer):
    sampler = GroupSampler(rewards=[hanging_reward], group_size=2, num_minibatches=1, reward_timeout_s=0.5, reward_errors="skip")
    module = ReinforceModule(policy, tokenizer, max_new_tokens=3)
    loader = DataLoader(_prompt_batches(2, 1), batch_size=None, collate_fn=lambda b: b)
    started = time.perf_counter()
    _trainer(sampler, 2).fit(module, loader)
    assert time.perf_counter() - started < 10  # two rounds, each waiting 0.5 s for the reward
    assert module.seen == [(0, 0, 4), (1, 0, 4)]
    metrics = module.trainer.callback_metrics
    assert metrics["rollout/reward_errors"] == 4 and metrics["rollout/groups_skipped"] == 2
    assert metrics["rollout/no_signal"] == 1 and metrics["time/reward_s"] >= 0.5


@pytest.mark.parametrize(("overflow", "cut", "skipped"), [("truncate", 1, 0), ("skip", 1, 1)])
def test_overlong_prompts_are_truncated_or_skipped(policy, tokenizer, overflow, cut, skipped):
    context = policy.config.max_position_embeddings
    sampler = GroupSampler(rewards=[_by_index], group_size=2, num_minibatches=1, prompt_overflow=overflow)
    rollout = sampler.sample(_caller(policy, tokenizer, context - 6), ["1+1=", "12345+67890="], COLUMNS)
    assert rollout.prompt_ids.shape[1] == 6  # the long prompt keeps its last 6 tokens
    assert tokenizer.decode(rollout.prompt_ids[2]) == "67890="
    stats = rollout_stats(rollout, 2)
    assert stats["prompts_truncated"] == cut and stats["prompts_skipped"] == skipped
    assert (rollout.advantages[2:] == 0).all().item() is bool(skipped)


def _by_index(prompts, completions, **columns):
    return [float(i) for i in range(len(completions))]


def test_an_overlong_prompt_is_an_error_by_default(policy, tokenizer):
    context = policy.config.max_position_embeddings
    sampler = GroupSampler(rewards=[_by_index], group_size=2, num_minibatches=1)
    with pytest.raises(ValueError, match=rf"prompt 1 of the batch has 12 tokens; with max_new_tokens={context - 6}"):
        sampler.sample(_caller(policy, tokenizer, context - 6), ["1+1=", "12345+67890="], COLUMNS)


class _Data(pl.LightningDataModule):
    def __init__(self, chat: bool, prompts_per_rollout: int = 2) -> None:
        super().__init__()
        self.formatter = PromptFormatter("{question}", chat=chat)
        self.prompts_per_rollout = prompts_per_rollout

    def train_dataloader(self):
        return DataLoader(_prompt_batches(1, 2), batch_size=None, collate_fn=lambda b: b)


class _LazyModule(ReinforceModule):
    """Builds nothing until configure_model, like a module with a large policy."""

    def __init__(self, policy, tokenizer):
        super().__init__(policy, tokenizer)
        self.configured = False

    def configure_model(self):
        self.configured = True


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_Data(chat=True), r"tokenizer has no chat template: set data.init_args.chat_template: false"),
        (_Data(chat=False, prompts_per_rollout=3), "sampler.num_minibatches=4 must divide the rollout batch of 6"),
    ],
)
def test_setup_errors_come_before_the_model_is_built(policy, tokenizer, data, message):
    module = _LazyModule(policy, tokenizer)
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=2, num_minibatches=4)
    with pytest.raises(ValueError, match=message):
        _trainer(sampler, 1).fit(module, datamodule=data)
    assert not module.configured


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reward_isolation": "fork"}, r"sampler.reward_isolation must be one of \['thread', 'process', 'none'\]"),
        ({"reward_errors": "ignore"}, r"sampler.reward_errors must be one of \['raise', 'skip'\]"),
        ({"prompt_overflow": "cut"}, r"sampler.prompt_overflow must be one of \['error', 'truncate', 'skip'\]"),
        ({"reward_timeout_s": 0}, "sampler.reward_timeout_s must be a number of seconds > 0, or null"),
        ({"reward_isolation": "none"}, "sampler.reward_timeout_s=60.0 needs sampler.reward_isolation 'thread'"),
    ],
)
def test_robustness_settings_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GroupSampler(rewards=[ExactAnswer()], **kwargs)


def test_no_isolation_without_timeout_is_accepted():
    sampler = GroupSampler(rewards=[ExactAnswer()], reward_isolation="none", reward_timeout_s=None)
    assert sampler.reward_runner.isolation == "none"
