import pytest
import torch

from gspo_lightning.engines.base import SamplingSettings
from gspo_lightning.logprobs import (
    chunkable_head,
    position_ids_from_mask,
    replaced_forward,
    response_logprobs,
    response_scores,
    token_logprobs,
)
from gspo_lightning.rollout.pipeline import encode_prompts


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


def _scored_batch(tokenizer):
    prompt_ids, prompt_mask = encode_prompts(tokenizer, ["1+2=", "123+456=", "9*9="], "cpu")
    response = torch.tensor([[4, 5, 1, 0], [6, 7, 8, 1], [3, 1, 0, 0]])  # token ids, padded after eos
    input_ids = torch.cat([prompt_ids, response], dim=1)
    attention = torch.cat([prompt_mask, torch.ones_like(response)], dim=1)
    return input_ids, attention, response.shape[1]


def _scores_and_grads(policy, batch, chunk_size):
    policy.zero_grad(set_to_none=True)
    scores = response_scores(policy, *batch, temperature=0.7, chunk_size=chunk_size, with_entropy=True)
    weights = torch.linspace(-1.0, 1.0, scores.logprobs.numel()).view_as(scores.logprobs)
    (scores.logprobs * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}
    return scores, grads


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_chunked_head_equals_materialised_logits_through_the_model(policy, tokenizer, chunk_size):
    batch = _scored_batch(tokenizer)
    naive, naive_grads = _scores_and_grads(policy, batch, chunk_size=0)
    chunked, chunked_grads = _scores_and_grads(policy, batch, chunk_size=chunk_size)
    torch.testing.assert_close(chunked.logprobs, naive.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked.entropy, naive.entropy, atol=1e-5, rtol=0)
    assert chunked_grads.keys() == naive_grads.keys() and "model.embed_tokens.weight" in naive_grads  # tied head
    for name, grad in naive_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert "forward" not in policy.get_output_embeddings().__dict__  # the head is itself again


def test_heads_that_are_not_plain_or_whose_output_is_transformed_use_materialised_logits(policy):
    assert chunkable_head(policy) is policy.get_output_embeddings()
    policy.config.final_logit_softcapping = 30.0
    try:
        assert chunkable_head(policy) is None
    finally:
        del policy.config.final_logit_softcapping
    assert chunkable_head(torch.nn.Linear(2, 2)) is None


def test_replaced_forward_restores_a_previous_override():
    module = torch.nn.Linear(2, 2)
    module.forward = lambda x: "outer"
    with replaced_forward(module, lambda x: "inner"):
        assert module(torch.zeros(2)) == "inner"
    assert module(torch.zeros(2)) == "outer"
