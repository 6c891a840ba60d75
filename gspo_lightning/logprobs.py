"""Per-token log-probabilities of chosen tokens under a causal LM.

The same function computes pi_old's log-probs right after sampling and pi_theta's in ``training_step``, on the
same tensors, so that on the first minibatch of a round the ratio is exactly 1.

By default the LM head runs chunked over tokens (:mod:`gspo_lightning.chunked_logprobs`), so the [n, R, V]
float32 logits never exist: while the policy's forward runs, its head's ``forward`` is swapped for one that
returns the log-probs of the response tokens. The head's weight is read inside the policy's own forward, where
FSDP has gathered it, and the log-probs are the forward's output, so FSDP gathers it again before their backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gspo_lightning.chunked_logprobs import UpstreamPredictor, chunked_head_logprobs
from gspo_lightning.micro_batches import BatchLayout, plan_micro_batches
from gspo_lightning.moe.routing import announce_places, routes_active
from gspo_lightning.packing import PackedRows, pack, response_predictors

DEFAULT_CHUNK_SIZE = 1024
"""Response tokens per LM-head chunk: [1024, V] float32 scores exist at a time (622 MB at V = 151,936)."""
# Config fields of models whose forward transforms the head's output (soft-capping, scaling): those models
# keep the materialised path, since the transform would be applied to log-probs.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass(frozen=True)
class TokenScores:
    """What the policy says about each response token.

    Attributes:
        logprobs: [n, R] float32 log-probabilities of the response tokens (differentiable).
        entropy: [n, R] float32 entropy of each position's distribution (no gradient), or None.
    """

    logprobs: Tensor
    entropy: Tensor | None = None


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
    return _response_forward(policy, input_ids, attention_mask, response_length).logits[:, :-1]  # [n, R, V]


def _response_forward(policy: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_length: int):
    """The policy's forward keeping only the positions that predict the response tokens (and the last)."""
    # Logits at position j predict token j + 1: the R response tokens need the R positions before them.
    return policy(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=response_length + 1,
        use_cache=False,
    )


def response_logprobs(
    policy: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_length: int,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    layout: BatchLayout = BatchLayout(),
) -> Tensor:
    """Log-probs [n, R] (float32) of the last ``response_length`` tokens of ``input_ids`` under ``policy``.

    ``temperature`` is the sampling temperature: the log-probs are those of the distribution that was sampled.
    Positions past EOS hold values the caller must mask. See :func:`response_scores` for ``chunk_size`` and
    ``layout``.
    """
    return response_scores(
        policy, input_ids, attention_mask, response_length, temperature, chunk_size, layout=layout
    ).logprobs


def response_scores(
    policy: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_length: int,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    predict_upstream: UpstreamPredictor | None = None,
    layout: BatchLayout = BatchLayout(),
) -> TokenScores:
    """Log-probs (and optionally entropies) of the last ``response_length`` tokens of ``input_ids``.

    Args:
        policy: a Hugging Face causal LM, possibly wrapped (FSDP, DDP, peft).
        input_ids: [n, L] left-padded prompt followed by the response.
        attention_mask: [n, L].
        response_length: R, the number of trailing response columns.
        temperature: the sampling temperature.
        chunk_size: response tokens per LM-head chunk; 0 materialises the [n, R, V] logits instead (the naive
            path, also taken when the head is not a plain ``nn.Linear`` or the model transforms its output).
        with_entropy: also return each position's entropy.
        predict_upstream: d loss / d logprobs of whole responses from their log-probs, so the chunked head
            prepares its gradients in forward (see :mod:`gspo_lightning.chunked_logprobs`).
        layout: ``packing``: run the forward over the sequences packed end to end (:mod:`gspo_lightning.packing`)
            instead of the padded rectangle, and the head over the attended response tokens only (padding
            positions then hold 0); ``micro_batch_tokens``: a few sequences at a time
            (:mod:`gspo_lightning.micro_batches`).
    """
    if layout.micro_batch_tokens is not None:
        return _micro_batched_scores(policy, input_ids, attention_mask, response_length, temperature, chunk_size,
                                     with_entropy, predict_upstream, layout)  # fmt: skip
    return _scores(policy, input_ids, attention_mask, response_length, temperature, chunk_size, with_entropy,
                   predict_upstream, layout.packing)  # fmt: skip


def _scores(
    policy: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_length: int,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
    predict_upstream: UpstreamPredictor | None,
    packing: bool,
    rows: Tensor | None = None,
) -> TokenScores:
    """:func:`response_scores` in one forward; ``rows``: which of the minibatch's rows these are (a micro-batch),
    so that a mixture-of-experts policy's recorded experts land in their places."""
    head = chunkable_head(policy) if chunk_size > 0 else None
    if packing:
        return _packed_scores(policy, input_ids, attention_mask, response_length, temperature, chunk_size, head,
                              with_entropy, predict_upstream, rows)  # fmt: skip
    tokens = input_ids[:, -response_length:]  # [n, R]
    _announce_places(attention_mask, rows)
    if head is None:
        logits = response_logits(policy, input_ids, attention_mask, response_length)  # [n, R, V]
        entropy = token_entropy(logits.detach(), temperature) if with_entropy else None
        return TokenScores(token_logprobs(logits, tokens, temperature), entropy)
    entropies: list[Tensor | None] = []

    def head_logprobs(hidden: Tensor) -> Tensor:  # [n, R + 1, H] the positions logits_to_keep kept
        logprobs, entropy = chunked_head_logprobs(
            hidden[:, :-1], head.weight, tokens, temperature, chunk_size, head.bias, with_entropy, predict_upstream
        )  # [n, R], [n, R] or None
        entropies.append(entropy)
        return logprobs  # [n, R] stands in for the logits the model returns

    with replaced_forward(head, head_logprobs):
        output = _response_forward(policy, input_ids, attention_mask, response_length)
    return TokenScores(output.logits, entropies[-1])


def _packed_scores(
    policy: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_length: int,
    temperature: float,
    chunk_size: int,
    head: nn.Linear | None,
    with_entropy: bool,
    predict_upstream: UpstreamPredictor | None,
    rows: Tensor | None,
) -> TokenScores:
    """:func:`response_scores` over packed rows: the same log-probs, scattered back to [n, R]."""
    packed = pack(input_ids, attention_mask)
    _announce_places(attention_mask, rows, packed)
    predictor, target = response_predictors(packed, attention_mask, response_length)  # [M], [M]
    tokens = input_ids[:, -response_length:].reshape(-1)[target]  # [M]
    entropies: list[Tensor | None] = [None]

    def head_logprobs(hidden: Tensor) -> Tensor:  # [B, S, H] every packed position
        chosen = hidden.reshape(-1, hidden.shape[-1])[predictor]  # [M, H]
        logprobs, entropies[0] = chunked_head_logprobs(
            chosen, head.weight, tokens, temperature, chunk_size, head.bias, with_entropy, predict_upstream,
            targets=target, response_length=response_length,
        )  # fmt: skip
        return logprobs  # [M]

    forward = dict(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
    if head is None:
        logits = policy(**forward).logits  # [B, S, V]
        chosen = logits.reshape(-1, logits.shape[-1])[predictor]  # [M, V]
        logprobs = token_logprobs(chosen, tokens, temperature)  # [M]
        entropies[0] = token_entropy(chosen.detach(), temperature) if with_entropy else None
    else:
        with replaced_forward(head, head_logprobs):
            logprobs = policy(**forward).logits  # [M]
    shape = (input_ids.shape[0], response_length)
    entropy = None if entropies[0] is None else _scattered(entropies[0], target, shape)
    return TokenScores(_scattered(logprobs, target, shape), entropy)


def _micro_batched_scores(
    policy: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_length: int,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
    predict_upstream: UpstreamPredictor | None,
    layout: BatchLayout,
) -> TokenScores:
    """:func:`response_scores` of the micro-batches ``plan_micro_batches`` cuts, put back together in [n, R].

    Under gradient every micro-batch but the last is checkpointed, so backward recomputes one micro-batch's
    forward at a time. Its LM head then recomputes its gradient too: a predicted one would be kept for every
    micro-batch until backward (one [V, H] float32 each); the last micro-batch keeps the prediction.
    """
    groups = plan_micro_batches(layout.costs(attention_mask), layout.micro_batch_tokens)
    logprobs, entropies = [], []
    for k, group in enumerate(groups):
        index = torch.tensor(group, device=input_ids.device)  # [n_k]
        last = k == len(groups) - 1
        predictor = None
        if last and predict_upstream is not None:
            predictor = _rows_of(predict_upstream, index)

        def scores(ids: Tensor, mask: Tensor, index=index, predictor=predictor) -> tuple[Tensor, Tensor | None]:
            part = _scores(policy, ids, mask, response_length, temperature, chunk_size, with_entropy, predictor,
                           layout.packing, index)  # fmt: skip
            return part.logprobs, part.entropy  # [n_k, R] each

        if torch.is_grad_enabled() and not last:
            part = checkpoint(scores, input_ids[index], attention_mask[index], use_reentrant=False)
        else:
            part = scores(input_ids[index], attention_mask[index])
        logprobs.append(part[0])
        entropies.append(part[1])
    order = torch.tensor([i for group in groups for i in group], device=input_ids.device)  # [n]
    shape = (input_ids.shape[0], response_length)
    entropy = None if entropies[0] is None else _in_rows(torch.cat(entropies), order, shape)
    return TokenScores(_in_rows(torch.cat(logprobs), order, shape), entropy)


def _announce_places(attention_mask: Tensor, rows: Tensor | None, packed: PackedRows | None = None) -> None:
    """Where the next forward's tokens sit in the minibatch, for a mixture-of-experts policy's open route capture
    or replay (:mod:`gspo_lightning.moe.routing`): the [n, L] rows ``rows`` (all when None), packed or not."""
    if not routes_active():
        return
    if rows is None and packed is None:
        announce_places(None)
        return
    n, length = attention_mask.shape
    device = attention_mask.device
    rows = torch.arange(n, device=device) if rows is None else rows
    flat = rows[:, None] * length + torch.arange(length, device=device)  # [n, L] places in the minibatch
    if packed is None:
        announce_places(flat.reshape(-1))
        return
    places = torch.full((packed.input_ids.numel(),), -1, dtype=torch.long, device=device)  # [B * S]
    real = packed.packed_index >= 0  # [n, L]
    places[packed.packed_index[real]] = flat[real]
    announce_places(places)


def _rows_of(predict: UpstreamPredictor, index: Tensor) -> UpstreamPredictor:
    """``predict`` for a micro-batch: its responses ``rows`` are the minibatch's responses ``index[rows]``."""
    return lambda logprobs, rows: predict(logprobs, index[rows])


def _in_rows(values: Tensor, order: Tensor, shape: tuple[int, int]) -> Tensor:
    """Rows ``values`` [n, R] of responses ``order`` back in minibatch order (differentiable)."""
    return values.new_zeros(shape).index_copy(0, order, values)  # [n, R]


def _scattered(values: Tensor, target: Tensor, shape: tuple[int, int]) -> Tensor:
    """``values`` [M] at the flat positions ``target`` of a zero [n, R] tensor (differentiable)."""
    return values.new_zeros(shape[0] * shape[1]).index_copy(0, target, values).view(shape)  # [n, R]


@torch.no_grad()
def check_packing(policy: nn.Module) -> None:
    """Stop with a clear error unless ``policy`` keeps packed sequences apart: a probe of two sequences, packed
    into one row, must score the second as it does alone. A model whose attention ignores restarting position
    ids would let it attend to the first, silently training on the wrong conditional."""
    device = next(policy.parameters()).device
    vocab = policy.get_input_embeddings().num_embeddings
    ids = (torch.arange(24, device=device).view(2, 12) * 7919 + 3) % vocab  # [2, 12] two unrelated sequences
    mask = torch.zeros_like(ids)
    mask[0, 6:], mask[1, 7:] = 1, 1  # 6 and 5 tokens: one packed row of 11
    padded = response_logprobs(policy, ids, mask, 4, chunk_size=0)  # [2, 4]
    packed = response_scores(policy, ids, mask, 4, chunk_size=0, layout=BatchLayout(packing=True)).logprobs  # [2, 4]
    gap = float((packed - padded).abs().max())
    tolerance = 1e-3 if next(policy.parameters()).dtype in (torch.float32, torch.float64) else 0.1
    if not gap <= tolerance:
        raise RuntimeError(
            f"model.packing=true: {type(policy).__name__} does not keep packed sequences apart (log-probs differ "
            f"from the padded forward's by {gap:.3g} > {tolerance}): its attention must honour restarting position "
            "ids (Hugging Face's sdpa, eager or flash attention); set model.packing: false"
        )


def chunkable_head(policy: nn.Module) -> nn.Linear | None:
    """The policy's LM head if log-probs can be computed from it chunk by chunk, else None."""
    get_head = getattr(policy, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear:  # e.g. a peft wrapper, or no head at all
        return None
    config = getattr(policy, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    return head


@contextmanager
def replaced_forward(module: nn.Module, forward: Callable[..., Tensor]) -> Iterator[None]:
    """Calls of ``module`` run ``forward`` instead, until the context exits (then any previous override is back)."""
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous
