"""What the sampler and the evaluation read from a data module is declared (``SamplerData``), read in one place
(``DataSide``), and a data module lacking what a setting needs is refused naming the member and the setting."""

from __future__ import annotations

import inspect

import pytest

from gspo_lightning.data import ArithmeticTask, PromptDataModule
from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.sampling import GroupSampler, HeldOutEvaluation
from gspo_lightning.rollout.data_contract import MEMBERS, METHODS, DataSide, SamplerData
from gspo_lightning.validation import SettingError
from tests.rollout.test_sampler import _trainer
from tests.rollout.test_sampler_robustness import _Data, _LazyModule


def test_the_members_named_in_errors_are_the_protocols():
    declared = set(SamplerData.__annotations__)
    methods = {name for name, _ in inspect.getmembers(SamplerData, inspect.isfunction) if not name.startswith("_")}
    assert set(MEMBERS) == declared | methods
    assert set(METHODS) == methods


def test_prompt_data_module_offers_every_member():
    data = DataSide(PromptDataModule(ArithmeticTask(num_digits=1), prompts_per_rollout=2))
    assert [member for member in MEMBERS if not data.offers(member)] == []
    assert (data.prompts_per_rollout(), data.chat(), data.template()) == (2, False, "{question}")


def test_no_data_module_offers_nothing_and_skips_the_checks():
    data = DataSide(None)
    assert not any(data.offers(member) for member in MEMBERS)
    assert (data.prompts_per_rollout(), data.chat(), data.template()) == (None, False, None)
    assert data.describe_split("eval") == "the 'eval' split"


def test_a_missing_member_is_named_with_the_setting_that_needs_it():
    with pytest.raises(SettingError) as raised:
        DataSide(_Data(chat=False)).needs("draw_prompts", "sampler.dynamic_sampling")
    assert str(raised.value) == (
        "sampler.dynamic_sampling needs the data module's draw_prompts() (more prompts from the stream) (the data "
        "module _Data has none): use gspo_lightning.data.PromptDataModule, or give yours what "
        "gspo_lightning.rollout.data_contract.SamplerData declares (docs/reuse.md)"
    )


def test_an_attribute_that_is_not_a_method_does_not_count_as_one():
    class Odd:
        draw_prompts = 3

    assert not DataSide(Odd()).offers("draw_prompts")


def test_dynamic_sampling_without_draw_prompts_stops_before_the_model_is_built(policy, tokenizer):
    module = _LazyModule(policy, tokenizer)
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=2, num_minibatches=1, dynamic_sampling=True)
    with pytest.raises(SettingError, match=r"^sampler.dynamic_sampling \(it refills a round with more prompts\) "
                                           r"needs the data module's draw_prompts\(\)"):  # fmt: skip
        _trainer(sampler, 1).fit(module, datamodule=_Data(chat=False))
    assert not module.configured


def test_the_evaluation_without_held_out_prompts_names_what_is_missing(policy, tokenizer):
    module = _LazyModule(policy, tokenizer)
    module.configured = True
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=2, num_minibatches=1)
    trainer = _trainer(sampler, 1)
    trainer.callbacks.append(HeldOutEvaluation(correct=ExactAnswer()))
    with pytest.raises(SettingError, match=r"^evaluation \(HeldOutEvaluation\) needs the data module's "
                                           r"heldout_dataloader\(\)"):  # fmt: skip
        trainer.fit(module, datamodule=_Data(chat=False))
