from types import SimpleNamespace

import pytest
import torch

from gspo_lightning.engines.base import SamplingSettings
from gspo_lightning.engines.hf import generate_groups, generate_responses, generate_with_logprobs, prefill_prompt_cache
from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.engines.base import decode_responses, response_mask_until_eos
from gspo_lightning.rollout.pipeline import encode_prompts, render_prompt

EOS = 1


def test_response_mask_keeps_tokens_up_to_and_including_first_eos():
    responses = torch.tensor([[5, 6, EOS, 0, 0], [5, EOS, 7, EOS, 0], [5, 6, 7, 8, 9], [EOS, 0, 0, 0, 0]])
    mask, truncated = response_mask_until_eos(responses, EOS)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, False, True, False]


def test_response_mask_when_pad_equals_eos():
    responses = torch.tensor([[5, EOS, EOS, EOS]])
    mask, truncated = response_mask_until_eos(responses, EOS)
    assert mask.tolist() == [[1, 1, 0, 0]] and truncated.tolist() == [False]


def test_encode_prompts_left_pads(tokenizer):
    ids, mask = encode_prompts(tokenizer, ["1+1=", "12+34="], "cpu")
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1], [1] * 6]
    assert ids[0, 0].item() == tokenizer.pad_token_id


def test_render_prompt_without_chat_template_names_the_setting(tokenizer):
    with pytest.raises(ValueError, match="chat_template"):
        render_prompt(tokenizer, [{"role": "user", "content": "1+1="}])


def test_render_prompt_with_chat_template(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    assert render_prompt(tokenizer, [{"role": "user", "content": "1+1"}]) == "1+1="


def test_generate_and_decode_stop_at_eos(policy, tokenizer):
    ids, mask = encode_prompts(tokenizer, ["1+1=", "2+2="], "cpu")
    torch.manual_seed(0)
    responses = generate_responses(policy, tokenizer, ids, mask, SamplingSettings(max_new_tokens=6))
    assert responses.shape[0] == 2 and responses.shape[1] <= 6
    response_mask, _ = response_mask_until_eos(responses, tokenizer.eos_token_id)
    texts = decode_responses(tokenizer, responses, response_mask)
    for text, row, row_mask in zip(texts, responses, response_mask):
        kept = [t for t, m in zip(row.tolist(), row_mask.tolist()) if m and t != tokenizer.eos_token_id]
        assert text == tokenizer.decode(kept, skip_special_tokens=True)


def test_greedy_settings_disable_sampling(tokenizer):
    config = SamplingSettings(max_new_tokens=4, temperature=0.0).generation_config(tokenizer)
    assert config.do_sample is False


# --- sharing the prompt prefill among a group's responses -------------------------------------------------------

GROUP = 3


def _sharpen(policy, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in policy.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 0.3, generator=generator)


@pytest.fixture
def sharp_policy(policy):
    """The tiny policy with large random weights: greedy responses differ between prompts and some end with EOS,
    where the default initialisation repeats one token whatever the prompt."""
    _sharpen(policy, 0)
    return policy


def _spy_generate(policy) -> list[dict]:
    """Record the keyword arguments of each ``policy.generate`` call (the call itself goes through)."""
    calls, original = [], policy.generate
    policy.generate = lambda **kwargs: calls.append(kwargs) or original(**kwargs)
    return calls


def _passed_cache(call: dict):
    return call.get("cache", call.get("past_key_values"))


def test_shared_prefill_gives_the_plain_greedy_responses(sharp_policy, tokenizer):
    ids, mask = encode_prompts(tokenizer, ["7", "1+1=", "123+456="], "cpu")  # [3, 8], left-padded 7 / 4 / 0
    settings = SamplingSettings(max_new_tokens=8, temperature=0.0)
    calls = _spy_generate(sharp_policy)
    plain, plain_logprobs = generate_with_logprobs(sharp_policy, tokenizer, ids, mask, settings, group_size=GROUP)
    shared, shared_logprobs = generate_with_logprobs(
        sharp_policy, tokenizer, ids, mask, settings, group_size=GROUP, share_prefill=True
    )  # [9, R] x2
    assert _passed_cache(calls[0]) is None
    cache = _passed_cache(calls[1])  # the shared path really ran: G rows per prompt, all columns but the last
    assert cache is not None and cache.layers[0].keys.shape[0] == 3 * GROUP
    assert torch.equal(shared, plain)
    # Same scores too, not only the same argmax (a position off by one can leave greedy tokens unchanged).
    torch.testing.assert_close(shared_logprobs, plain_logprobs, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == ids.shape[1] + shared.shape[1] - 1  # generate ran on it (grew it in place)
    first_of_each = plain[::GROUP]  # [3, R]
    assert len({tuple(row) for row in first_of_each.tolist()}) == 3  # the prompts are told apart
    assert torch.equal(plain, first_of_each.repeat_interleave(GROUP, dim=0))  # rows i*G .. i*G+G-1: prompt i


def test_shared_prefill_samples_from_the_policys_distribution(sharp_policy, tokenizer):
    ids, mask = encode_prompts(tokenizer, ["7", "1+1=", "123+456="], "cpu")
    settings = SamplingSettings(max_new_tokens=6, temperature=0.7)
    torch.manual_seed(0)
    responses, logprobs = generate_with_logprobs(
        sharp_policy, tokenizer, ids, mask, settings, group_size=GROUP, share_prefill=True
    )  # [9, R] x2
    response_mask, _ = response_mask_until_eos(responses, tokenizer.eos_token_id)  # [9, R]
    sequences = torch.cat([ids.repeat_interleave(GROUP, dim=0), responses], dim=1)  # [9, Lp + R]
    attention = torch.cat([mask.repeat_interleave(GROUP, dim=0), response_mask], dim=1)  # [9, Lp + R]
    with torch.no_grad():
        recomputed = response_logprobs(sharp_policy, sequences, attention, responses.shape[1], temperature=0.7)
    kept = response_mask.bool()
    torch.testing.assert_close(logprobs[kept], recomputed[kept], rtol=0, atol=1e-5)
    assert len({tuple(row) for row in responses.tolist()}) > 3  # sampled: a group's responses differ


def _greedy_without_stopping(policy, tokenizer, ids, mask, max_new_tokens: int) -> torch.Tensor:
    """Greedy responses that run the full ``max_new_tokens``: EOS is swapped for an id the model never emits."""
    config = SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.0).generation_config(tokenizer)
    config.eos_token_id = policy.config.vocab_size
    return generate_groups(policy, ids, mask, config, False, GROUP)[:, ids.shape[1] :]  # [P * G, max_new_tokens]


@pytest.mark.parametrize("share_prefill", [False, True])
def test_generation_stops_once_every_response_has_ended(policy, tokenizer, share_prefill):
    ids, mask = encode_prompts(tokenizer, ["1+1=", "123+456="], "cpu")
    max_new_tokens = 12
    # Greedy tokens of random weights depend on the CPU's rounding, so the weights are chosen here, on this
    # machine: the first seed whose prompts both reach EOS before the token budget, after different lengths.
    for seed in range(256):
        _sharpen(policy, seed)
        reference = _greedy_without_stopping(policy, tokenizer, ids, mask, max_new_tokens)  # [6, 12]
        reference_mask, truncated = response_mask_until_eos(reference, tokenizer.eos_token_id)  # [6, 12], [6]
        lengths = reference_mask.sum(-1)  # [6]
        if not truncated.any() and lengths.max() < max_new_tokens and lengths.min() < lengths.max():
            break
    else:
        pytest.fail("no seed in 0..255 gives greedy responses that all end, after different lengths")
    settings = SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.0)
    responses = generate_responses(
        policy, tokenizer, ids, mask, settings, group_size=GROUP, share_prefill=share_prefill
    )  # [6, R]
    assert responses.shape[1] == lengths.max()  # no step past the last EOS
    response_mask, _ = response_mask_until_eos(responses, tokenizer.eos_token_id)  # [6, R]
    assert torch.equal(response_mask.sum(-1), lengths)
    kept = reference_mask[:, : responses.shape[1]].bool()  # [6, R]
    assert torch.equal(responses[kept], reference[:, : responses.shape[1]][kept])
    assert (responses[~kept] == tokenizer.pad_token_id).all()  # ended rows are padded, not continued


def test_shared_prefill_with_one_group_member_is_the_plain_path(sharp_policy, tokenizer):
    ids, mask = encode_prompts(tokenizer, ["1+1=", "2"], "cpu")
    settings = SamplingSettings(max_new_tokens=4, temperature=0.0)
    calls = _spy_generate(sharp_policy)
    shared = generate_responses(sharp_policy, tokenizer, ids, mask, settings, group_size=1, share_prefill=True)
    plain = generate_responses(sharp_policy, tokenizer, ids, mask, settings, group_size=1)
    assert [_passed_cache(call) for call in calls] == [None, None]
    assert torch.equal(shared, plain)


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_single_column_prompts_still_share_the_prefill(sharp_policy, tokenizer, with_logprobs):
    """A masked padding column makes room for the prefill, so every rank runs the same forwards."""
    ids, mask = encode_prompts(tokenizer, ["1", "2"], "cpu")  # Lp = 1
    settings = SamplingSettings(max_new_tokens=4, temperature=0.0)
    generate = generate_with_logprobs if with_logprobs else generate_responses
    calls = _spy_generate(sharp_policy)
    shared = generate(sharp_policy, tokenizer, ids, mask, settings, group_size=GROUP, share_prefill=True)
    plain = generate(sharp_policy, tokenizer, ids, mask, settings, group_size=GROUP)
    assert _passed_cache(calls[0]) is not None and calls[0]["input_ids"].shape == (2 * GROUP, 2)
    for got, want in zip(shared if with_logprobs else [shared], plain if with_logprobs else [plain], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_shared_prefill_refuses_a_recurrent_state_cache(tokenizer):
    from transformers import cache_utils

    if not hasattr(cache_utils, "LinearAttentionLayer"):
        pytest.skip("this transformers has no linear-attention cache layers")

    class StateSpacePolicy(torch.nn.Module):
        def forward(self, **kwargs):
            cache = cache_utils.DynamicCache()
            cache.layers = [cache_utils.LinearAttentionLayer()]
            return SimpleNamespace(cache=cache, past_key_values=cache)

        def generate(self, **kwargs):
            self.generate_kwargs = kwargs
            return kwargs["input_ids"]

    ids, mask = encode_prompts(tokenizer, ["1+1=", "2+2="], "cpu")
    with pytest.raises(ValueError, match="share_prompt_prefill: false"):
        prefill_prompt_cache(StateSpacePolicy(), ids, mask, GROUP)
    # the sampler's default path warns and samples without a shared cache instead of failing
    policy, settings = StateSpacePolicy(), SamplingSettings(max_new_tokens=2)
    with pytest.warns(UserWarning, match="without sharing the prompt prefill"):
        generate_responses(policy, tokenizer, ids, mask, settings, group_size=GROUP, share_prefill=True)
    assert _passed_cache(policy.generate_kwargs) is None and len(policy.generate_kwargs["input_ids"]) == 2 * GROUP


def _logprobs_from_output_logits(policy, tokenizer, ids, mask, settings, share_prefill):
    """The former path: every step's raw logits kept by ``generate`` ([N, R, V]), scored afterwards."""
    from gspo_lightning.logprobs import token_logprobs

    config = settings.generation_config(tokenizer)
    config.return_dict_in_generate, config.output_logits = True, True
    output = generate_groups(policy, ids, mask, config, False, GROUP, share_prefill)
    responses = output.sequences[:, ids.shape[1] :]  # [N, R]
    logits = torch.stack(output.logits, dim=1)  # [N, R, V]
    return responses, token_logprobs(logits, responses, settings.temperature or 1.0)


@pytest.mark.parametrize(
    "settings",
    [
        SamplingSettings(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=20),
        SamplingSettings(max_new_tokens=7, temperature=1.3),
        SamplingSettings(max_new_tokens=7, temperature=0.0),
    ],
    ids=["warped", "plain", "greedy"],
)
@pytest.mark.parametrize("share_prefill", [False, True])
def test_sampled_logprobs_equal_the_kept_logits_path(sharp_policy, tokenizer, settings, share_prefill):
    """One step's logits held at a time give what holding all of them gave: same tokens, same log-probs, rows
    that ended early included (their positions after EOS are junk in both and are compared under the mask)."""
    ids, mask = encode_prompts(tokenizer, ["7", "1+1=", "123+456="], "cpu")
    torch.manual_seed(3)
    want_ids, want = _logprobs_from_output_logits(sharp_policy, tokenizer, ids, mask, settings, share_prefill)
    torch.manual_seed(3)
    calls = _spy_generate(sharp_policy)
    got_ids, got = generate_with_logprobs(
        sharp_policy, tokenizer, ids, mask, settings, group_size=GROUP, share_prefill=share_prefill
    )  # [9, R] x2
    assert not calls[0]["generation_config"].output_logits  # memory O(N x V), not O(N x R x V)
    assert torch.equal(got_ids, want_ids)
    kept, _ = response_mask_until_eos(got_ids, tokenizer.eos_token_id)  # [9, R]
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got[kept.bool()], want[kept.bool()])
    if settings.temperature:  # sampled rows end at different steps: the early-EOS rows are covered
        assert len(set(kept.sum(-1).tolist())) > 1
