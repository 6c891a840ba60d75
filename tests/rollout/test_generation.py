import pytest
import torch

from gspo_lightning.rollout.generation import (
    SamplingSettings,
    decode_responses,
    encode_prompts,
    generate_responses,
    render_prompt,
    response_mask_until_eos,
)

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
