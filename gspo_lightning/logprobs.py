"""Per-token log-probabilities of chosen tokens under a causal LM.

The same function computes pi_old's log-probs right after sampling and pi_theta's in ``training_step``, on the
same tensors, so that on the first minibatch of a round the ratio is exactly 1.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, exactly as ``generate`` builds them, so scores match sampling."""
    positions = attention_mask.long().cumsum(-1) - 1  # [n, L]
    return positions.masked_fill(attention_mask == 0, 0)


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) at ``tokens``, in float32 whatever the logits' dtype.

    Args:
        logits: [n, R, V] scores predicting each token.
        tokens: [n, R] the tokens whose log-probability is wanted.
    Returns:
        [n, R] float32 log-probabilities.
    """
    scaled = logits.float() / temperature  # [n, R, V]
    chosen = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [n, R]
    return chosen - torch.logsumexp(scaled, dim=-1)  # [n, R]


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) at each position, float32: [n, R, V] -> [n, R]."""
    scaled = logits.float() / temperature  # [n, R, V]
    log_probs = torch.log_softmax(scaled, dim=-1)  # [n, R, V]
    return -(log_probs.exp() * log_probs).sum(-1)  # [n, R]


def response_logits(policy: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_length: int) -> Tensor:
    """The policy's logits predicting each of the last ``response_length`` tokens of ``input_ids``.

    Args:
        policy: a Hugging Face causal LM (anything that accepts ``logits_to_keep``).
        input_ids: [n, L] left-padded prompt followed by the response.
        attention_mask: [n, L].
        response_length: R, the number of trailing response columns.
    Returns:
        [n, R, V] logits in the model's dtype.
    """
    # Logits at position j predict token j + 1: the R response tokens need the R positions before them.
    output = policy(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=response_length + 1,
        use_cache=False,
    )
    return output.logits[:, :-1]  # [n, R, V]


def response_logprobs(
    policy: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_length: int, temperature: float = 1.0
) -> Tensor:
    """Log-probs [n, R] (float32) of the last ``response_length`` tokens of ``input_ids`` under ``policy``.

    ``temperature`` is the sampling temperature: the log-probs are those of the distribution that was sampled.
    Positions past EOS hold values the caller must mask.
    """
    logits = response_logits(policy, input_ids, attention_mask, response_length)  # [n, R, V]
    return token_logprobs(logits, input_ids[:, -response_length:], temperature)
