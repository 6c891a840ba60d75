"""chunked_head_logprobs: the same values and gradients as the materialised log-softmax, without [N, V] tensors."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gspo_lightning.chunked_logprobs import chunked_head_logprobs
from gspo_lightning.logprobs import token_entropy, token_logprobs


def naive(hidden, weight, tokens, temperature=1.0, bias=None):
    logits = torch.nn.functional.linear(hidden, weight, bias)  # [..., V]
    return token_logprobs(logits, tokens, temperature), token_entropy(logits.detach(), temperature)


def inputs(n=37, h=16, v=50, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=generator, dtype=dtype).requires_grad_()
    weight = torch.randn(v, h, generator=generator, dtype=dtype).requires_grad_()
    bias = torch.randn(v, generator=generator, dtype=dtype).requires_grad_()
    tokens = torch.randint(0, v, (n,), generator=generator)
    upstream = torch.randn(n, generator=generator, dtype=torch.float32)
    return hidden, weight, bias, tokens, upstream


def gradients(function, hidden, weight, bias, tokens, upstream):
    for tensor in (hidden, weight, bias):
        tensor.grad = None
    logprobs, entropy = function()
    (logprobs * upstream).sum().backward()
    return logprobs.detach(), entropy, hidden.grad.clone(), weight.grad.clone(), bias.grad.clone()


def test_hand_computed_values():
    # logits of the one position: [2, 0, -1] / T with T = 2 -> [1, 0, -0.5]
    hidden = torch.tensor([[1.0, 0.0]])
    weight = torch.tensor([[2.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    normaliser = math.log(math.e + 1 + math.exp(-0.5))
    logprobs, entropy = chunked_head_logprobs(hidden, weight, torch.tensor([2]), temperature=2.0, with_entropy=True)
    assert logprobs.item() == pytest.approx(-0.5 - normaliser, abs=1e-6)
    probs = [math.exp(z - normaliser) for z in (1.0, 0.0, -0.5)]
    assert entropy.item() == pytest.approx(-sum(p * math.log(p) for p in probs), abs=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 5, 37, 100])
def test_values_and_gradients_equal_the_materialised_path(chunk_size):
    hidden, weight, bias, tokens, upstream = inputs()
    expected = gradients(lambda: naive(hidden, weight, tokens, 0.7, bias), hidden, weight, bias, tokens, upstream)
    chunked = gradients(
        lambda: chunked_head_logprobs(hidden, weight, tokens, 0.7, chunk_size, bias, with_entropy=True),
        hidden, weight, bias, tokens, upstream,
    )  # fmt: skip
    for got, want in zip(chunked, expected, strict=True):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_float64_gradcheck():
    hidden, weight, bias, tokens, _ = inputs(n=7, h=4, v=6, dtype=torch.float64)

    def function(hidden, weight, bias):
        return chunked_head_logprobs(hidden, weight, tokens, 0.9, chunk_size=3, bias=bias)[0].double()

    # the float32 result of the log-softmax limits precision: compare at float32-level tolerances
    assert torch.autograd.gradcheck(function, (hidden, weight, bias), eps=1e-3, atol=1e-3, rtol=1e-3)


def test_keeps_leading_shape_and_skips_gradients_not_needed():
    hidden, weight, _, tokens, _ = inputs(n=12)
    weight.requires_grad_(False)  # a frozen head, as under LoRA
    logprobs, entropy = chunked_head_logprobs(hidden.view(3, 4, -1), weight, tokens.view(3, 4), chunk_size=5)
    assert logprobs.shape == (3, 4) and logprobs.dtype == torch.float32 and entropy is None
    logprobs.sum().backward()
    assert weight.grad is None and hidden.grad.shape == hidden.shape


def test_bfloat16_weights_compute_like_the_model():
    hidden, weight, _, tokens, upstream = inputs(dtype=torch.bfloat16)
    expected = naive(hidden, weight, tokens)[0]
    logprobs = chunked_head_logprobs(hidden, weight, tokens, chunk_size=8)[0]
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)
    (logprobs * upstream).sum().backward()
    assert weight.grad.dtype == torch.bfloat16 and hidden.grad.dtype == torch.bfloat16


def test_autocast_matmul_dtype_is_respected():
    hidden, weight, _, tokens, upstream = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = naive(hidden, weight, tokens)[0]
        logprobs = chunked_head_logprobs(hidden, weight, tokens, chunk_size=8)[0]
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)
    # a float32 matmul would differ from the bfloat16 one by far more than the tolerance above
    assert (logprobs - naive(hidden, weight, tokens)[0]).abs().max() > 1e-3


class LargestTensor(TorchDispatchMode):
    """Records the most elements any op output had."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_tensor_spans_all_tokens_and_the_vocabulary():
    n, h, v, chunk = 64, 8, 300, 8
    hidden, weight, _, tokens, upstream = inputs(n=n, h=h, v=v)
    with LargestTensor() as recorder:
        logprobs, _ = chunked_head_logprobs(hidden, weight, tokens, chunk_size=chunk, with_entropy=True)
        (logprobs * upstream).sum().backward()
    assert recorder.largest <= max(chunk * v, v * h)  # one chunk's scores, or the weight's gradient
    with LargestTensor() as materialised:
        (naive(hidden, weight, tokens)[0] * upstream).sum().backward()
    assert materialised.largest == n * v  # the recorder does see full logits where they exist


def test_validation():
    hidden, weight, _, tokens, _ = inputs(n=4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_head_logprobs(hidden, weight, tokens, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_head_logprobs(hidden, weight, tokens, temperature=0.0)


def _rows(n=6, r=4, h=8, v=40):
    hidden, weight, bias, tokens, upstream = inputs(n=n * r, h=h, v=v)
    return hidden, weight, bias, tokens, upstream, (n, r)


def _counting_recompute(monkeypatch):
    from gspo_lightning import chunked_logprobs

    calls = []
    real = chunked_logprobs._recomputed_grads
    monkeypatch.setattr(chunked_logprobs, "_recomputed_grads", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize(("chunk_size", "scale"), [(4, 1.0), (9, 1.0), (100, 1.0), (8, 3.0)])
def test_predicted_upstream_gives_exact_gradients_without_recomputing(monkeypatch, chunk_size, scale):
    hidden, weight, bias, tokens, upstream, (n, r) = _rows()
    seen = []

    def predict(logprobs, rows):  # the loss below is sum(upstream * logprobs): its gradient is upstream
        seen.append((rows, logprobs.shape))
        return upstream.view(n, r)[rows]

    calls = _counting_recompute(monkeypatch)
    expected = gradients(lambda: naive(hidden.view(n, r, -1), weight, tokens.view(n, r), 0.7, bias), hidden, weight, bias, tokens, upstream.view(n, r) * scale)  # fmt: skip
    chunked = gradients(
        lambda: chunked_head_logprobs(hidden.view(n, r, -1), weight, tokens.view(n, r), 0.7, chunk_size, bias, True, predict),
        hidden, weight, bias, tokens, upstream.view(n, r) * scale,
    )  # fmt: skip
    for got, want in zip(chunked, expected, strict=True):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert calls == []  # the prediction held (up to the uniform scale): backward recomputed nothing
    per_chunk = max(chunk_size // r, 1)  # whole responses per chunk
    assert [rows for rows, _ in seen] == [slice(i, min(i + per_chunk, n)) for i in range(0, n, per_chunk)]


def test_a_wrong_prediction_is_corrected_exactly(monkeypatch):
    hidden, weight, bias, tokens, upstream, (n, r) = _rows()
    calls = _counting_recompute(monkeypatch)
    expected = gradients(lambda: naive(hidden, weight, tokens, 1.0, bias), hidden, weight, bias, tokens, upstream)
    wrong = gradients(
        lambda: chunked_head_logprobs(hidden.view(n, r, -1), weight, tokens.view(n, r), 1.0, 8, bias, False,
                                      lambda logprobs, rows: torch.ones_like(logprobs)),
        hidden, weight, bias, tokens, upstream.view(n, r),
    )  # fmt: skip
    for got, want in zip(wrong[2:], expected[2:], strict=True):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert calls == [1]


def test_no_prediction_is_made_without_autograd():
    hidden, weight, _, tokens, _, (n, r) = _rows()

    def predict(logprobs, rows):
        raise AssertionError("called although no backward can follow")

    with torch.no_grad():
        chunked_head_logprobs(hidden.view(n, r, -1), weight, tokens.view(n, r), predict_upstream=predict)
    with pytest.raises(ValueError, match="predict_upstream needs hidden states"):
        chunked_head_logprobs(hidden, weight, tokens, predict_upstream=predict)
