"""Turning prompts into sampled responses: tokenisation, ``generate``, response masks.

Pure helpers over a Hugging Face policy and tokenizer; no Lightning here, so they serve the sampler callback,
the held-out evaluation and anyone's own loop alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import GenerationConfig, PreTrainedTokenizerBase

from gspo_lightning.logprobs import token_logprobs
from gspo_lightning.rollout.types import Prompt


@dataclass(frozen=True)
class SamplingSettings:
    """How responses are drawn. ``temperature=0`` means greedy decoding; ``top_k=0`` disables top-k."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def generation_config(self, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
        greedy = self.temperature == 0
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else self.temperature,
            top_p=None if greedy else self.top_p,
            top_k=None if greedy else self.top_k,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> str:
    """A plain prompt as is; a chat conversation through the tokenizer's chat template."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the prompts are chat messages (data chat_template=true) but the tokenizer has no chat template: "
            "set data.init_args.chat_template=false, or use a tokenizer that defines one"
        )
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list[Prompt], device: torch.device | str
) -> tuple[Tensor, Tensor]:
    """Left-padded prompt ids and attention mask, [P, Lp] each."""
    texts = [render_prompt(tokenizer, p) for p in prompts]
    # A chat template already writes the special tokens the model expects.
    add_special = all(isinstance(p, str) for p in prompts)
    tokenizer.padding_side = "left"
    encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=add_special)
    return encoded["input_ids"].to(device), encoded["attention_mask"].to(device)


@torch.no_grad()
def generate_responses(
    policy: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    settings: SamplingSettings,
    synced_gpus: bool = False,
) -> Tensor:
    """Sample one response per row; returns the response tokens [N, R], R <= max_new_tokens, pad after EOS."""
    config = settings.generation_config(tokenizer)
    sequences = policy.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config, synced_gpus=synced_gpus
    )  # [N, Lp + R]
    return sequences[:, prompt_ids.shape[1] :]


def generate_with_logprobs(
    policy: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    settings: SamplingSettings,
    synced_gpus: bool = False,
) -> tuple[Tensor, Tensor]:
    """Like :func:`generate_responses`, also returning the sampler's own log-probs of the sampled tokens.

    Returns:
        response_ids: [N, R].
        logprobs: [N, R] float32 log softmax(logits / temperature) at each sampled token, from the logits
            ``generate`` computed (in whatever precision it ran), before any top-p / top-k truncation, as
            :func:`gspo_lightning.logprobs.token_logprobs` defines them. Positions after EOS hold junk.
    """
    config = settings.generation_config(tokenizer)
    config.return_dict_in_generate, config.output_logits = True, True
    output = policy.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config, synced_gpus=synced_gpus
    )
    response_ids = output.sequences[:, prompt_ids.shape[1] :]  # [N, R]
    logits = torch.stack(output.logits, dim=1)  # [N, R, V] raw scores, one step per response position
    return response_ids, token_logprobs(logits, response_ids, settings.temperature or 1.0)


def response_mask_until_eos(response_ids: Tensor, eos_token_id: int) -> tuple[Tensor, Tensor]:
    """Mask of the tokens up to and including the first EOS, and which responses never reached EOS.

    Returns:
        mask: [N, R] long, 1 on response tokens (EOS included: the policy must learn to stop).
        truncated: [N] bool, True where no EOS was produced within max_new_tokens.
    """
    is_eos = (response_ids == eos_token_id).long()  # [N, R]
    eos_before = is_eos.cumsum(-1) - is_eos  # [N, R] EOS tokens strictly before t
    mask = (eos_before == 0).long()  # [N, R]
    truncated = is_eos.sum(-1) == 0  # [N]
    return mask, truncated


def decode_responses(tokenizer: PreTrainedTokenizerBase, response_ids: Tensor, response_mask: Tensor) -> list[str]:
    """The text of each response, without EOS and what follows it."""
    lengths = response_mask.sum(-1).tolist()
    rows = [ids[:length] for ids, length in zip(response_ids.tolist(), lengths)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
