"""pi_old from the engine's own log-probs (``sampler.old_logprobs: engine``), optionally from a bf16 pass."""

from __future__ import annotations

import pytest
import torch

from gspo_lightning.engines import HFEngine
from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.models import TinyQwen3
from gspo_lightning.module import GSPOModule
from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.rollout.minibatches import split_minibatches
from gspo_lightning.sampling.sampler import GroupSampler
from tests.conftest import TINY


@pytest.fixture(scope="module")
def module():
    module = GSPOModule(TinyQwen3(**TINY), max_new_tokens=5)
    module.configure_model()
    return module


def _minibatch_and_recomputed(module, sampling_dtype="auto", **settings):
    engine = HFEngine(sampling_dtype=sampling_dtype)
    sampler = GroupSampler(
        rewards=[ExactAnswer()], group_size=4, num_minibatches=1, engine=engine, **settings
    )
    torch.manual_seed(0)
    with torch.no_grad():
        rollout = sampler.sample(module, ["1+1=", "12+34="], {"answer": ["2", "46"]})
        (minibatch,) = split_minibatches(rollout, 1, module.policy, old_from_engine=sampler.old_logprobs == "engine")
        recomputed = response_logprobs(
            module.policy, minibatch.input_ids, minibatch.attention_mask, minibatch.response_ids.shape[1]
        )
    mask = minibatch.response_mask.bool()
    return minibatch, recomputed, mask


def test_engine_logprobs_in_full_precision_equal_the_recomputed_ones(module):
    minibatch, recomputed, mask = _minibatch_and_recomputed(module, old_logprobs="engine")
    torch.testing.assert_close(minibatch.old_logprobs[mask], recomputed[mask], rtol=0, atol=1e-5)
    assert minibatch.old_logprobs.dtype == torch.float32


def test_a_bf16_sampling_pass_gives_slightly_different_old_logprobs(module):
    minibatch, recomputed, mask = _minibatch_and_recomputed(module, old_logprobs="engine", sampling_dtype="bfloat16")
    difference = (minibatch.old_logprobs[mask] - recomputed[mask]).abs().max()
    assert 1e-5 < difference < 0.1  # bf16 rounding of the logits, not a different distribution


def test_recompute_is_the_default_and_is_exactly_on_policy(module):
    minibatch, recomputed, mask = _minibatch_and_recomputed(module, sampling_dtype="bfloat16")
    assert torch.equal(minibatch.old_logprobs, recomputed)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"old_logprobs": "sampler"}, r"sampler.old_logprobs must be one of \['recompute', 'engine'\], got 'sampler' \(renamed"),
        ({"engine": "sglang"}, r"sampler.engine must be one of \['hf', 'vllm', 'vllm_process', 'vllm_server'\] or a SamplingEngine class_path"),
    ],
)
def test_bad_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        GroupSampler(rewards=[ExactAnswer()], **settings)
    with pytest.raises(ValueError, match=r"sampler.engine.sampling_dtype must be one of \['auto', 'bfloat16', 'float16'\]"):
        HFEngine(sampling_dtype="fp8")
