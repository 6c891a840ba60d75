"""Log-probs of chosen tokens through the LM head, chunked over tokens, without the [N, V] float32 logits.

The naive path ``log_softmax((hidden @ W.T).float())`` holds several [N, V] float32 tensors at once (the
logits, the log-softmax output kept for backward, and in backward its gradient and the logits' gradient). For
a 152k vocabulary and 8 x 1024 tokens each is 5 GB. Here the head is applied to ``chunk_size`` tokens at a
time, and at most one chunk's [C, V] scores exist at once.

Backward needs each chunk's softmax again. Two ways to have it:

- recompute: forward keeps only the log-sum-exp [N]; backward recomputes every chunk's logits (one more
  matmul than the naive path, about 4/3 of its time where the matmuls dominate, as on a CPU);
- predicted upstream gradient: the caller passes ``predict_upstream``, which gives d loss / d logprobs for a
  chunk of whole responses from their log-probs alone (true of every objective in
  :mod:`gspo_lightning.objectives`: the loss is a sum over responses with normalisers fixed by the masks).
  Forward then turns each chunk's softmax into the hidden-state and weight gradients while it still has it,
  which is the naive path's matmul count. Backward checks the gradient that actually arrives against the
  prediction: a uniform scale (loss scaling, gradient accumulation) is applied to the stored gradients; any
  other difference is added exactly by the recompute path. The result is exact either way.

The per-token result is :func:`gspo_lightning.logprobs.token_logprobs` of the head's logits:
``log softmax(logits / temperature)[token]`` in float32, the matmul in the dtype the naive path would use
(the weight's, or autocast's when it is on), so values and gradients agree to float tolerance.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

UpstreamPredictor = Callable[[Tensor, slice | Tensor], Tensor]
"""``(logprobs [k, R] of responses ``rows``, rows) -> d loss / d logprobs [k, R]`` for those responses (``rows``: a
slice, or the responses' [k] indices)."""

_PREDICTION_RTOL = 1e-5  # residual norm, relative to the arriving gradient's, under which the prediction is used as is


@dataclass(frozen=True)
class _HeadSpec:
    """How the head's matmul is computed, fixed at forward time so backward recomputes the same logits."""

    temperature: float
    chunk_size: int  # tokens in the largest chunk
    compute_dtype: torch.dtype
    bounds: tuple[tuple[int, int], ...]  # each chunk's [begin, end) tokens; with a predictor, whole responses


@dataclass(frozen=True)
class _Layout:
    """Where the flat tokens [N] sit among the responses [n, R], for the predictor (which takes whole responses).

    Padded: N = n * R, token i is response i // R, column i % R. Packed: ``targets`` [N] is each token's flat
    index into [n, R] (sorted), and only the tokens the forward scored are there."""

    row_length: int  # R
    targets: Tensor | None = None  # [N] int64, packed only

    def responses(self, begin: int, end: int) -> slice:
        """The responses whose tokens are ``[begin, end)`` (a chunk cut at response boundaries)."""
        if self.targets is None:
            return slice(begin // self.row_length, end // self.row_length)
        return slice(int(self.targets[begin]) // self.row_length, int(self.targets[end - 1]) // self.row_length + 1)

    def predict(self, predict: UpstreamPredictor, logprobs: Tensor, begin: int, end: int) -> Tensor:
        """d loss / d logprobs [end - begin] of a chunk's tokens, from the predictor over its whole responses."""
        responses = self.responses(begin, end)
        if self.targets is None:
            return predict(logprobs.view(-1, self.row_length), responses).reshape(-1)
        where = self.targets[begin:end] - responses.start * self.row_length  # [C] into the chunk's [k, R]
        block = logprobs.new_zeros((responses.stop - responses.start) * self.row_length)  # [k * R]
        block[where] = logprobs
        return predict(block.view(-1, self.row_length), responses).reshape(-1)[where]


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` would run in: autocast's when enabled, else the weight's."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _chunk_scores(hidden: Tensor, weight: Tensor, bias: Tensor | None, spec: _HeadSpec, out: Tensor) -> Tensor:
    """float32 ``logits / temperature`` of one chunk, [C, H] -> [C, V], written into ``out`` ([>= C, V]).

    One buffer serves every chunk: a fresh [C, V] tensor per chunk would be fresh pages (and page faults) each
    time on the CPU, where large allocations go straight back to the operating system.
    """
    scores = out[: hidden.shape[0]]  # [C, V]
    with torch.autocast(hidden.device.type, enabled=False):  # the dtype is chosen explicitly
        if spec.compute_dtype == torch.float32:
            torch.matmul(hidden.float(), weight.float().T, out=scores)
        else:
            scores.copy_(hidden.to(spec.compute_dtype) @ weight.to(spec.compute_dtype).T)
        if bias is not None:
            scores += bias.to(spec.compute_dtype).float()
    return scores.div_(spec.temperature) if spec.temperature != 1.0 else scores


def _normalise_in_place(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Turn ``scores`` [C, V] into softmax probabilities in place; returns them and the log-sum-exp [C]."""
    largest = scores.amax(dim=-1, keepdim=True)  # [C, 1]
    total = scores.sub_(largest).exp_().sum(dim=-1, keepdim=True)  # [C, 1]
    return scores.div_(total), (largest + total.log()).squeeze(-1)


def _scaled_to(values: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``values`` (float32) divided by the power of two that brings its largest magnitude into [1, 2), cast to
    ``dtype`` (exact but for the cast), and that power of two; no host sync."""
    largest = values.abs().amax()
    power = torch.exp2(torch.floor(torch.log2(largest)))  # 0 when every value is 0
    scale = torch.where(largest > 0, power, torch.ones_like(power))
    return (values / scale).to(dtype), scale


@dataclass
class _HeadGrads:
    """Gradients of the head's inputs, accumulated chunk by chunk (float32 for the weight and bias)."""

    hidden: Tensor | None  # [N, H]
    weight: Tensor | None  # [V, H]
    bias: Tensor | None  # [V]

    @classmethod
    def zeros(cls, hidden: Tensor, weight: Tensor, bias: Tensor | None, needed: tuple[bool, ...]) -> _HeadGrads:
        return cls(
            torch.zeros_like(hidden) if needed[0] else None,
            torch.zeros_like(weight, dtype=torch.float32) if needed[1] else None,
            torch.zeros_like(bias, dtype=torch.float32) if needed[2] and bias is not None else None,
        )

    def add_chunk(self, probs: Tensor, upstream: Tensor, tokens: Tensor, hidden: Tensor, weight: Tensor,
                  spec: _HeadSpec, rows: slice) -> None:  # fmt: skip
        """Add one chunk's share, given its softmax [C, V] (overwritten) and d loss / d logprobs [C]."""
        upstream = upstream.float() / spec.temperature  # d scores / d logits = 1 / temperature
        # d logp(token) / d scores = onehot(token) - softmax
        grad_scores = probs.mul_(-upstream[:, None])  # [C, V]
        grad_scores.scatter_add_(-1, tokens[:, None], upstream[:, None])
        if self.bias is not None:
            self.bias += grad_scores.sum(0)
        if self.hidden is None and self.weight is None:
            return
        with torch.autocast(grad_scores.device.type, enabled=False):
            if spec.compute_dtype == torch.float32:
                if self.hidden is not None:
                    self.hidden[rows] += (grad_scores @ weight.float()).to(self.hidden.dtype)  # [C, H]
                if self.weight is not None:
                    self.weight.addmm_(grad_scores.T, hidden.float())  # [V, H] accumulated without a temporary
                return
            # The gradients of a response-averaged loss are tiny (~1 / (N |y|)): in float16 they would underflow
            # before any loss scale reaches them. Scaled by powers of two to order 1 (exact in any float format),
            # cast, multiplied and scaled back in float32, they keep the half format's relative precision.
            grad_logits, grad_scale = _scaled_to(grad_scores, spec.compute_dtype)  # [C, V], []
            if self.hidden is not None:
                part = (grad_logits @ weight.to(spec.compute_dtype)).float()  # [C, H]
                self.hidden[rows] += (part * grad_scale).to(self.hidden.dtype)
            if self.weight is not None:
                # Both factors of order 1: the sum over the C rows stays within float16's range (C <= 16k).
                hidden_half, hidden_scale = _scaled_to(hidden.float(), spec.compute_dtype)  # [C, H], []
                self.weight += (grad_logits.T @ hidden_half).float() * (grad_scale * hidden_scale)  # [V, H]

    def scaled(self, scale: float, weight: Tensor, bias: Tensor | None) -> tuple[Tensor | None, ...]:
        """The gradients times ``scale``, in the dtypes of the tensors they belong to. Scales in place: no second
        [V, H] copy at the peak of backward; the accumulators are not used afterwards."""
        grads = []
        for grad, like in ((self.hidden, None), (self.weight, weight), (self.bias, bias)):
            if grad is not None and scale != 1.0:
                grad.mul_(scale)
            grads.append(grad if grad is None or like is None else grad.to(like.dtype))
        return tuple(grads)


def _recomputed_grads(ctx, saved: tuple[Tensor | None, ...], upstream: Tensor) -> _HeadGrads:
    """The head's input gradients for ``upstream`` [N], recomputing each chunk's softmax from the inputs
    (``saved``: ``ctx.saved_tensors``, unpacked once, as checkpointing requires)."""
    hidden, weight, bias, tokens, log_normaliser = saved[:5]
    spec: _HeadSpec = ctx.spec
    grads = _HeadGrads.zeros(hidden, weight, bias, ctx.needs_input_grad[:3])
    buffer = hidden.new_empty(min(spec.chunk_size, hidden.shape[0]), weight.shape[0], dtype=torch.float32)
    for begin, end in spec.bounds:
        rows = slice(begin, end)
        scores = _chunk_scores(hidden[rows], weight, bias, spec, buffer)  # [C, V]
        probs = scores.sub_(log_normaliser[rows, None]).exp_()  # [C, V]
        grads.add_chunk(probs, upstream[rows], tokens[rows], hidden[rows], weight, spec, rows)
    return grads


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], bias [V] | None, tokens [N]) -> (logprobs [N], entropy [N])``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, spec: _HeadSpec, with_entropy: bool, predict, layout: _Layout):
        logprobs = hidden.new_empty(hidden.shape[0], dtype=torch.float32)  # [N]
        log_normaliser = torch.empty_like(logprobs)  # [N] logsumexp
        entropy = torch.zeros_like(logprobs)  # [N]
        predicted = torch.zeros_like(logprobs) if predict is not None else None  # [N] d loss / d logprobs
        grads = _HeadGrads.zeros(hidden, weight, bias, ctx.needs_input_grad[:3]) if predict is not None else None
        buffer = hidden.new_empty(min(spec.chunk_size, hidden.shape[0]), weight.shape[0], dtype=torch.float32)
        for begin, end in spec.bounds:
            rows = slice(begin, end)
            scores = _chunk_scores(hidden[rows], weight, bias, spec, buffer)  # [C, V]
            chosen = scores.gather(-1, tokens[rows, None]).squeeze(-1)  # [C]
            probs, log_normaliser[rows] = _normalise_in_place(scores)  # [C, V], [C]
            logprobs[rows] = chosen - log_normaliser[rows]
            if with_entropy:
                entropy[rows] = torch.special.entr(probs).sum(-1)  # [C] sum of -p log p
            if predict is not None:  # whole responses: their gradient is known now
                predicted[rows] = layout.predict(predict, logprobs[rows], begin, end)
                grads.add_chunk(probs, predicted[rows], tokens[rows], hidden[rows], weight, spec, rows)
        ctx.save_for_backward(hidden, weight, bias, tokens, log_normaliser, predicted)
        ctx.spec, ctx.grads = spec, grads
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        saved = ctx.saved_tensors  # once: a checkpointed forward's tensors can be unpacked only once
        weight, bias, predicted = saved[1], saved[2], saved[5]
        grad_logprobs = grad_logprobs.float()  # [N]
        if predicted is None or ctx.grads is None:  # no prediction, or a second backward (retain_graph=True)
            grads = _recomputed_grads(ctx, saved, grad_logprobs).scaled(1.0, weight, bias)
            return (*grads, None, None, None, None, None)
        scale, residual = _fit_scale(predicted, grad_logprobs)
        grads = ctx.grads.scaled(scale, weight, bias)
        if residual is not None:  # the prediction was not the gradient: add the difference exactly
            correction = _recomputed_grads(ctx, saved, residual).scaled(1.0, weight, bias)
            grads = tuple(None if g is None else g + c for g, c in zip(grads, correction, strict=True))
        ctx.grads = None
        return (*grads, None, None, None, None, None)


def _fit_scale(predicted: Tensor, actual: Tensor) -> tuple[float, Tensor | None]:
    """``actual ~= scale * predicted``: the least-squares scale, and the residual unless it is negligible."""
    norm = predicted.dot(predicted)
    scale = float(actual.dot(predicted) / norm) if norm > 0 else 0.0
    residual = actual - scale * predicted  # [N]
    # A norm over the whole gradient: an extra loss term spread thinly over many tokens adds up, even where each
    # element is far below the largest.
    if residual.norm() <= _PREDICTION_RTOL * actual.norm():
        return scale, None
    return scale, residual


def chunk_tokens(chunk_size: int, row_length: int) -> int:
    """Tokens per chunk for responses of ``row_length`` tokens: the most whole responses that fit in
    ``chunk_size`` (so a chunk's gradient can be predicted from its own responses), or ``chunk_size`` tokens when
    one response is longer (memory stays bounded by ``chunk_size`` whatever the length; the gradient is then
    recomputed in backward). A function of the shapes only: pi_old's pass and the training pass, with and
    without a predictor, cut the same chunks, so their matmuls (and their rounding, on any device) are equal."""
    if row_length <= chunk_size:
        return (chunk_size // row_length) * row_length
    return chunk_size


def response_bounds(targets: Tensor, row_length: int, chunk_size: int) -> tuple[tuple[int, int], ...] | None:
    """Chunks of whole responses of at most ``chunk_size`` tokens, for packed tokens at ``targets`` (their sorted
    flat indices into [n, R]); None when a response alone has more (it cannot be one chunk). Like
    :func:`chunk_tokens`, a function of the layout only."""
    counts = torch.bincount(targets // row_length).tolist()  # [n] tokens per response (0 for trailing none)
    if max(counts, default=0) > chunk_size:
        return None
    bounds, begin, end = [], 0, 0
    for count in counts:
        if end + count - begin > chunk_size:
            bounds.append((begin, end))
            begin = end
        end += count
    if end > begin:
        bounds.append((begin, end))
    return tuple(bounds)


def _even_bounds(total: int, chunk_size: int) -> tuple[tuple[int, int], ...]:
    return tuple((begin, min(begin + chunk_size, total)) for begin in range(0, total, chunk_size))


def chunked_head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    bias: Tensor | None = None,
    with_entropy: bool = False,
    predict_upstream: UpstreamPredictor | None = None,
    targets: Tensor | None = None,
    response_length: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and optionally entropies) of ``tokens`` under ``softmax((hidden @ weight.T + bias) / T)``.

    Args:
        hidden: [..., H] final hidden states (after the model's last norm), one per predicted token; [n, R, H]
            with ``predict_upstream``, or [M, H] with ``targets``.
        weight: [V, H] the LM head's weight.
        tokens: [...] the token each hidden state predicts.
        temperature: the sampling temperature the scores are for.
        chunk_size: tokens whose [chunk_size, V] float32 scores exist at once; rounded down to whole responses
            where one fits (see :func:`chunk_tokens` and :func:`response_bounds`).
        bias: [V] the head's bias, if it has one.
        with_entropy: also return the entropy of each token's distribution (no gradient).
        predict_upstream: d loss / d logprobs of whole responses from their log-probs (see the module
            docstring); backward then costs no matmul when the prediction holds. Ignored (the gradient is
            recomputed in backward) when a response is longer than ``chunk_size``.
        targets: packed tokens only ([M] hidden states): each one's sorted flat index into the responses
            [n, ``response_length``], so the predictor sees whole responses.
    Returns:
        logprobs: [...] float32, differentiable with respect to ``hidden``, ``weight`` and ``bias``.
        entropy: [...] float32, or None without ``with_entropy``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if predict_upstream is not None and hidden.dim() != 3 and targets is None:
        raise ValueError(f"predict_upstream needs hidden states [n, R, H] or targets, got {tuple(hidden.shape)}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    if targets is not None:
        layout = _Layout(response_length, targets)
        bounds = response_bounds(targets, response_length, chunk_size)
    else:
        layout = _Layout(tokens.shape[-1] if hidden.dim() == 3 else 1)
        size = chunk_tokens(chunk_size, layout.row_length)
        bounds = _even_bounds(flat_hidden.shape[0], size) if size % layout.row_length == 0 else None
    if bounds is None:
        if predict_upstream is not None:
            # A response spans chunks: its gradient is only known after all of them, when their softmax is gone.
            warnings.warn(
                "responses are longer than model.logprob_chunk_size tokens: the LM head's gradient is recomputed "
                "in backward for them (one more matmul; memory stays bounded by the chunk size)",
                stacklevel=2,
            )
        predict_upstream = None
        bounds = _even_bounds(flat_hidden.shape[0], chunk_size)
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        predict_upstream = None  # no backward will come: nothing to prepare for it
    largest = max((end - begin for begin, end in bounds), default=1)
    spec = _HeadSpec(temperature, largest, _compute_dtype(hidden, weight), bounds)
    logprobs, entropy = _ChunkedHeadLogprobs.apply(
        flat_hidden, weight, bias, tokens.reshape(-1), spec, with_entropy, predict_upstream, layout
    )  # [N], [N]
    return logprobs.view(tokens.shape), entropy.view(tokens.shape) if with_entropy else None
