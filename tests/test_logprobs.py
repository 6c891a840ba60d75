import torch

from gspo_lightning.logprobs import position_ids_from_mask, response_logprobs, token_logprobs
from gspo_lightning.rollout.generation import SamplingSettings, encode_prompts


def test_token_logprobs_matches_log_softmax_and_is_float32():
    logits = torch.randn(2, 3, 5, dtype=torch.bfloat16)
    tokens = torch.tensor([[0, 4, 2], [1, 1, 3]])
    expected = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, tokens[..., None]).squeeze(-1)
    result = token_logprobs(logits, tokens, temperature=0.7)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, expected, atol=1e-6, rtol=0)


def test_position_ids_skip_left_padding_like_generate():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_response_logprobs_equal_the_scores_generate_sampled_from(policy, tokenizer):
    """pi_old recorded after sampling is the distribution ``generate`` actually drew from (left padding too)."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, ["1+2=", "123+456="], "cpu")
    torch.manual_seed(0)
    settings = SamplingSettings(max_new_tokens=5, temperature=0.8)
    out = policy.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        generation_config=settings.generation_config(tokenizer),
        output_logits=True,
        return_dict_in_generate=True,
    )
    response = out.sequences[:, prompt_ids.shape[1] :]  # [2, R]
    gen_logits = torch.stack(out.logits, dim=1)  # [2, R, V] raw logits of each generation step
    expected = token_logprobs(gen_logits, response, temperature=0.8)
    attention = torch.cat([prompt_mask, torch.ones_like(response)], dim=1)
    with torch.no_grad():
        result = response_logprobs(policy, out.sequences, attention, response.shape[1], temperature=0.8)
    torch.testing.assert_close(result, expected, atol=1e-5, rtol=0)
