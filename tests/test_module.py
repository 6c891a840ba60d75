import pytest
import torch

from gspo_lightning.models import TinyQwen3
from gspo_lightning.module import GSPOModule
from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.rollout.minibatches import split_minibatches
from gspo_lightning.rollout.sampler import GroupSampler
from gspo_lightning.rollout.types import PromptBatch
from tests.conftest import TINY


def test_paper_clip_ranges_are_the_defaults():
    gspo = GSPOModule(TinyQwen3(**TINY))
    grpo = GSPOModule(TinyQwen3(**TINY), objective="grpo")
    assert (gspo.eps_low, gspo.eps_high) == (3e-4, 4e-4)
    assert (grpo.eps_low, grpo.eps_high) == (0.2, 0.27)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eps_low": 0.0}, r"model.eps_low must be in \(0, 1\), got 0.0"),
        ({"eps_high": 1.0}, r"model.eps_high must be in \(0, 1\), got 1.0"),
        ({"objective": "ppo"}, r"model.objective must be one of \['grpo', 'gspo'\]"),
        ({"lr": -1.0}, "model.lr must be > 0"),
    ],
)
def test_bad_settings_fail_before_the_model_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GSPOModule(TinyQwen3(**TINY), **kwargs)


def test_training_step_on_first_minibatch_is_on_policy():
    module = GSPOModule(TinyQwen3(**TINY))
    module.configure_model()
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=4, num_minibatches=1, max_new_tokens=4)
    batch = PromptBatch(["1+1=", "2+2="], {"answer": ["2", "4"]}, num_minibatches=1)
    torch.manual_seed(0)
    rollout = sampler.sample(module, batch.prompts, batch.columns)
    batch.minibatch = split_minibatches(rollout, 1, module.policy)[0]
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    module.log_dict = lambda values, **kwargs: logged.update(values)
    loss = module.training_step(batch, 0)
    loss.backward()
    assert logged["train/ratio_mean"] == 1.0 and logged["train/clip_frac"] == 0.0
    assert all(p.grad is not None for p in module.policy.parameters() if p.requires_grad)


def test_training_step_without_sampler_says_what_is_missing():
    module = GSPOModule(TinyQwen3(**TINY))
    with pytest.raises(RuntimeError, match="add gspo_lightning.GroupSampler"):
        module.training_step(PromptBatch(["1+1="], {}), 0)
