from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from gspo_lightning.diagnostics import length_bucket_edges, ratio_diagnostics, sequence_ratios
from gspo_lightning.objectives import grpo_loss, gspo_loss

EPS = 0.1  # eps_low = eps_high = 0.1 in the hand-computed cases: clip range [0.9, 1.1]

# Per-token log-ratios x = log pi_theta - log pi_old of 5 responses and one empty one, and their advantages.
LOG_RATIOS = [
    [0.2, 0.0],  # |y| = 2, log s = 0.1, s = 1.105171 > 1.1 with A > 0: clipped high
    [-0.3, -0.3, 0.0],  # |y| = 3, log s = -0.2, s = 0.818731 < 0.9 with A < 0: clipped low
    [0.3],  # |y| = 1, log s = 0.3, s = 1.349859, A < 0: not clipped (only s < 0.9 is)
    [0.05, -0.05, 0.0],  # |y| = 3, log s = 0, s = 1: inside the range
    [0.5, 0.0, 0.0, 0.0, 0.0],  # |y| = 5, log s = 0.1, s = 1.105171, A = 0: never clipped
    [],  # empty response, A > 0: excluded everywhere
]
ADVANTAGES = [1.0, -1.0, -1.0, 1.0, 0.0, 1.0]
LOG_S = [0.1, -0.2, 0.3, 0.0, 0.1]
T = 6


def make_batch(
    log_ratios: list[list[float]] = LOG_RATIOS, padding: float = 0.0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """logprobs (leaf, requires grad), old_logprobs, advantages and a float mask; ``padding`` fills non-tokens."""
    lengths = torch.tensor([len(row) for row in log_ratios])  # [N]
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [N, T]
    delta = torch.tensor([row + [0.0] * (T - len(row)) for row in log_ratios]).reshape(len(log_ratios), T)
    old = torch.where(mask, torch.full((len(log_ratios), T), -2.0), torch.full((len(log_ratios), T), padding))
    logprobs = torch.where(mask, old + delta, torch.full_like(old, padding)).requires_grad_(True)
    return logprobs, old, torch.tensor(ADVANTAGES[: len(log_ratios)]), mask.float()


def diagnostics(level: str, edges=(), batch=None) -> dict[str, Tensor]:
    logprobs, old, advantages, mask = batch if batch is not None else make_batch()
    return ratio_diagnostics(logprobs, old, advantages, mask, EPS, EPS, level, edges)


def close(actual: Tensor, expected: float) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


def test_sequence_level_clip_fractions() -> None:
    stats = diagnostics("sequence")
    # Responses 0 (high) and 1 (low) of the 5 valid ones are clipped.
    close(stats["clip_frac_resp"], 2 / 5)
    close(stats["clip_frac_resp_low"], 1 / 5)
    close(stats["clip_frac_resp_high"], 1 / 5)
    # Token-weighted (the objective's stat) differs: (2 + 3) clipped tokens of 2 + 3 + 1 + 3 + 5 = 14.
    logprobs, old, advantages, mask = make_batch()
    close(gspo_loss(logprobs, old, advantages, mask, EPS, EPS)[1]["clip_frac"], 5 / 14)


def test_token_level_clip_fractions() -> None:
    stats = diagnostics("token")
    # Token ratios: response 0: e^0.2 = 1.2214 > 1.1 (A > 0) -> 1 of 2 tokens clipped high;
    # response 1: e^-0.3 = 0.7408 < 0.9 (A < 0) -> 2 of 3 tokens clipped low; response 2: e^0.3 with A < 0 -> none;
    # response 3: e^0.05 = 1.0513 <= 1.1 -> none; response 4: A = 0 -> none.
    # Mean over the 5 responses: low (2/3) / 5 = 0.133333, high (1/2) / 5 = 0.1, total (7/6) / 5 = 0.233333.
    close(stats["clip_frac_resp_low"], (2 / 3) / 5)
    close(stats["clip_frac_resp_high"], (1 / 2) / 5)
    close(stats["clip_frac_resp"], (2 / 3 + 1 / 2) / 5)
    # Token-weighted: 3 of 14 tokens.
    logprobs, old, advantages, mask = make_batch()
    close(grpo_loss(logprobs, old, advantages, mask, EPS, EPS)[1]["clip_frac"], 3 / 14)


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_sequence_ratio_quantiles(level: str) -> None:
    stats = diagnostics(level)  # always the sequence ratio, whatever the ratio level
    # Sorted s: [e^-0.2, e^0, e^0.1, e^0.1, e^0.3] = [0.818731, 1, 1.105171, 1.105171, 1.349859];
    # linear interpolation at position q * (5 - 1) = 4q.
    s = sorted(math.exp(x) for x in LOG_S)
    close(stats["seq_ratio_p05"], s[0] + 0.2 * (s[1] - s[0]))  # position 0.2: 0.818731 + 0.2 * 0.181269 = 0.854985
    close(stats["seq_ratio_p25"], s[1])  # position 1: 1.0
    close(stats["seq_ratio_p50"], s[2])  # position 2: 1.105171
    close(stats["seq_ratio_p75"], s[3])  # position 3: 1.105171
    close(stats["seq_ratio_p95"], s[3] + 0.8 * (s[4] - s[3]))  # position 3.8: 1.105171 + 0.8 * 0.244688 = 1.300921
    # Sorted |log s|: [0, 0.1, 0.1, 0.2, 0.3]: p50 at position 2 = 0.1, p95 at 3.8 = 0.2 + 0.8 * 0.1 = 0.28.
    close(stats["abs_log_seq_ratio_p50"], 0.1)
    close(stats["abs_log_seq_ratio_p95"], 0.28)
    close(stats["abs_log_seq_ratio_max"], 0.3)


def test_length_buckets() -> None:
    # Edges (2, 4): [1, 2) holds response 2 (1 token); [2, 4) responses 0, 1, 3 (2 + 3 + 3 = 8 tokens);
    # [4, inf) response 4 (5 tokens). The empty response is in none.
    stats = diagnostics("sequence", (2, 4))
    close(stats["clip_frac_len_1_2"], 0.0)
    close(stats["clip_frac_len_2_4"], 5 / 8)  # responses 0 and 1 clipped as units: 2 + 3 tokens
    close(stats["clip_frac_len_4_inf"], 0.0)
    stats = diagnostics("token", (2, 4))
    close(stats["clip_frac_len_2_4"], 3 / 8)  # 1 clipped token in response 0, 2 in response 1
    # Edges (2, 4, 10): [4, 10) holds response 4, [10, inf) is empty and reads 0.
    stats = diagnostics("sequence", [2, 4, 10])
    assert {name for name in stats if name.startswith("clip_frac_len")} == {
        "clip_frac_len_1_2", "clip_frac_len_2_4", "clip_frac_len_4_10", "clip_frac_len_10_inf"
    }
    close(stats["clip_frac_len_10_inf"], 0.0)
    assert not any(name.startswith("clip_frac_len") for name in diagnostics("sequence"))


def test_kl_old_theta() -> None:
    # k3 = expm1(x) - x per token, mean over the 14 response tokens (zeros give 0):
    # f(0.2) + 2 f(-0.3) + f(0.3) + f(0.05) + f(-0.05) + f(0.5) = 0.021403 + 2 * 0.040818 + 0.049859
    # + 0.001271 + 0.001229 + 0.148721 = 0.304120, / 14 = 0.021723.
    xs = [0.2, -0.3, -0.3, 0.3, 0.05, -0.05, 0.5]
    expected = sum(math.expm1(x) - x for x in xs) / 14
    close(diagnostics("sequence")["kl_old_theta"], expected)
    logprobs, old, advantages, mask = make_batch()
    stats = ratio_diagnostics(old.clone(), old, advantages, mask, EPS, EPS, "token", (2, 4))
    assert stats["kl_old_theta"] == 0.0  # exactly: expm1(0) - 0
    assert stats["clip_frac_resp"] == 0.0 and stats["seq_ratio_p05"] == 1.0 and stats["seq_ratio_p95"] == 1.0


def test_empty_response_is_excluded() -> None:
    with_empty, without = diagnostics("token", (2, 4)), diagnostics("token", (2, 4), make_batch(LOG_RATIOS[:5]))
    for name, value in with_empty.items():
        torch.testing.assert_close(value, without[name], atol=0, rtol=0)


@pytest.mark.parametrize("rows", [3, 0])
def test_all_empty_batch_is_finite(rows: int) -> None:
    batch = make_batch([[]] * rows)
    for level in ("sequence", "token"):
        stats = diagnostics(level, (2, 4), batch)
        assert all(torch.isfinite(value) for value in stats.values())
        for name, value in stats.items():
            assert value == (1.0 if name.startswith("seq_ratio_p") else 0.0), name
    logprobs, old, _, mask = batch
    assert sequence_ratios(logprobs, old, mask).shape == (0,)


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_padding_values_change_nothing(level: str) -> None:
    clean = diagnostics(level, (2, 4))
    for padding in (1e30, -1e30, float("inf"), float("nan")):
        stats = diagnostics(level, (2, 4), make_batch(padding=padding))
        for name, value in clean.items():
            torch.testing.assert_close(stats[name], value, atol=0, rtol=0)


def test_huge_log_ratios_stay_finite() -> None:
    stats = diagnostics("token", (2,), make_batch([[1e4, 0.0], [-1e4], [0.0]]))
    assert all(torch.isfinite(value) for value in stats.values())
    assert stats["kl_old_theta"] > 0


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_outputs_are_detached_float32_scalars(level: str) -> None:
    logprobs, old, advantages, mask = make_batch()
    advantages.requires_grad_(True)
    stats = ratio_diagnostics(logprobs, old, advantages, mask, EPS, EPS, level, (2, 4))
    assert len(stats) == 3 + 5 + 3 + 3 + 1
    assert all(v.dim() == 0 and v.dtype == torch.float32 and not v.requires_grad for v in stats.values())
    ratios = sequence_ratios(logprobs, old, mask)
    assert not ratios.requires_grad and ratios.dtype == torch.float32
    torch.testing.assert_close(ratios, torch.tensor([math.exp(x) for x in LOG_S]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_response_clip_fraction_matches_naive_loop(seed: int) -> None:
    torch.manual_seed(seed)
    n, length, eps_low, eps_high = 64, 12, 0.02, 0.03
    lengths = torch.randint(0, length + 1, (n,))  # some empty responses
    mask = torch.arange(length)[None, :] < lengths[:, None]  # [N, T]
    old = torch.randn(n, length) - 2.0
    logprobs = torch.where(mask, old + 0.05 * torch.randn(n, length), torch.randn(n, length) * 1e3)
    advantages = torch.randn(n)  # [N]
    stats = ratio_diagnostics(logprobs, old, advantages, mask, eps_low, eps_high, "sequence")
    low = high = valid = 0
    for i in range(n):
        tokens = [j for j in range(length) if mask[i, j]]
        if not tokens:
            continue
        valid += 1
        s = math.exp(sum(float(logprobs[i, j]) - float(old[i, j]) for j in tokens) / len(tokens))
        low += float(advantages[i]) < 0 and s < 1 - eps_low
        high += float(advantages[i]) > 0 and s > 1 + eps_high
    assert 0 < low + high < valid  # the case is not degenerate
    close(stats["clip_frac_resp_low"], low / valid)
    close(stats["clip_frac_resp_high"], high / valid)
    close(stats["clip_frac_resp"], (low + high) / valid)


def test_length_bucket_edges() -> None:
    assert length_bucket_edges(1024) == [257, 513, 769]  # lengths 1-256, 257-512, 513-768, 769-1024
    assert length_bucket_edges(10, 3) == [4, 7]  # 1-3, 4-6, 7-10
    assert length_bucket_edges(4, 4) == [2, 3, 4]  # one length each
    assert length_bucket_edges(2, 4) == [2]  # fewer lengths than buckets: deduplicated
    assert length_bucket_edges(1, 4) == [] and length_bucket_edges(100, 1) == []
    with pytest.raises(ValueError):
        length_bucket_edges(0)


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError, match="ratio_level"):
        diagnostics("tokens")
    with pytest.raises(ValueError, match="increasing"):
        diagnostics("sequence", (4, 4))
    with pytest.raises(ValueError, match=">= 2"):
        diagnostics("sequence", (1, 4))


def test_clip_fraction_by_lag_by_hand():
    from gspo_lightning.diagnostics import by_lag

    # responses of 2, 4 and 2 tokens with 1, 0 and 2 clipped tokens; lags 0, 1, 1: lag 0: 1/2, lag 1: (0 + 2)/(4 + 2)
    clipped, lengths = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([2.0, 4.0, 2.0])
    stats = by_lag(clipped / lengths, lengths, torch.tensor([0, 1, 1]), "clip_frac")
    assert stats == {"clip_frac_lag_0": torch.tensor(0.5), "clip_frac_lag_1": torch.tensor(2 / 6)}
    assert by_lag(clipped, torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0, 1, 2]), "x") == {"x_lag_1": torch.tensor(0.0)}


def test_ratio_diagnostics_split_the_clip_fraction_by_lag():
    logprobs = torch.tensor([[0.0, 0.0], [0.5, 0.5]])  # response 1 moved far: clipped (A > 0, ratio e^0.5)
    old = torch.zeros(2, 2)
    stats = ratio_diagnostics(logprobs, old, torch.ones(2), torch.ones(2, 2), 0.2, 0.2, "sequence",
                              lags=torch.tensor([0, 3]))  # fmt: skip
    assert stats["clip_frac_lag_0"] == 0.0 and stats["clip_frac_lag_3"] == 1.0
    assert "clip_frac_lag_1" not in stats
