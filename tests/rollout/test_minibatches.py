import pytest
import torch

from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.rollout.minibatches import check_divisible, split_minibatches
from gspo_lightning.rollout.types import Rollout


def _rollout(tokenizer, policy, prompts, response_lengths, width=6):
    """A rollout with hand-chosen prompts (left padded) and responses of given lengths (EOS last)."""
    from gspo_lightning.rollout.pipeline import encode_prompts

    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, "cpu")
    n = len(prompts)
    response_ids = torch.full((n, width), tokenizer.pad_token_id)
    response_mask = torch.zeros(n, width, dtype=torch.long)
    digit = tokenizer.convert_tokens_to_ids("7")
    for i, length in enumerate(response_lengths):
        response_ids[i, : length - 1] = digit
        response_ids[i, length - 1] = tokenizer.eos_token_id
        response_mask[i, :length] = 1
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        rewards=torch.arange(n, dtype=torch.float32),
        advantages=torch.linspace(-1, 1, n),
        truncated=torch.zeros(n, dtype=torch.bool),
    )


def test_minibatches_are_contiguous_and_trimmed(tokenizer, policy):
    rollout = _rollout(tokenizer, policy, ["1+1=", "1+1=", "123+456=", "123+456="], [2, 3, 1, 2])
    first, second = split_minibatches(rollout, 2, policy)
    assert first.input_ids.shape == (2, 4 + 3)  # short prompts, longest response 3
    assert second.input_ids.shape == (2, 8 + 2)
    torch.testing.assert_close(second.advantages, rollout.advantages[2:])
    assert first.old_logprobs.dtype == torch.float32
    assert first.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]


def test_old_logprobs_do_not_depend_on_padding(tokenizer, policy):
    """A response's pi_old log-probs are the same alone as inside a padded minibatch."""
    rollout = _rollout(tokenizer, policy, ["1+1=", "123+456="], [4, 2])
    (batched,) = split_minibatches(rollout, 1, policy)
    (alone,) = split_minibatches(_rollout(tokenizer, policy, ["1+1="], [4]), 1, policy)
    torch.testing.assert_close(batched.old_logprobs[0], alone.old_logprobs[0], atol=1e-5, rtol=0)


def test_first_minibatch_ratio_is_exactly_one(tokenizer, policy):
    """pi_old is computed on the same tensors training uses: before any update the ratio is exactly 1."""
    rollout = _rollout(tokenizer, policy, ["1+1=", "123+456="], [4, 2])
    (minibatch,) = split_minibatches(rollout, 1, policy)
    logprobs = response_logprobs(policy, minibatch.input_ids, minibatch.attention_mask, minibatch.response_ids.shape[1])
    assert torch.equal(logprobs.detach(), minibatch.old_logprobs)


def test_num_minibatches_must_divide_the_rollout():
    with pytest.raises(ValueError, match=r"sampler.num_minibatches=3 must divide the rollout batch of 8 responses .*allowed: \[1, 2, 4, 8\]"):
        check_divisible(8, 3)
