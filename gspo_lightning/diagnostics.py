"""Per-step diagnostics that explain a GSPO/GRPO run: clip fractions, the ratio's spread, KL(pi_old || pi_theta).

Pure functions of tensors, cheap enough for every training step: no Python loops over responses and no host
synchronisation (no ``.item()``, no boolean indexing) except in ``sequence_ratios``, which returns a
variable-length tensor. Every value is detached float32. Responses without tokens (a mask row of zeros) are
left out; a minibatch without any response token gives 0 (1 for ratios), never NaN. Padding contributes
nothing, even NaN/inf values. The token-weighted clip fractions of figure 2 are in the objectives' stats
(``clip_frac*``); the ones here weigh each response once, split by response length, and describe the ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from gspo_lightning.objectives import exp_with_linear_tail, k3_from_log_ratio, sequence_log_ratio
from gspo_lightning.objectives.clipping import (
    clipped_surrogate,
    mean_over_valid,
    token_log_ratio,
    validate_shapes,
)

RatioLevel = Literal["sequence", "token"]
RATIO_LEVELS: tuple[str, ...] = ("sequence", "token")
SEQ_RATIO_QUANTILES: tuple[float, ...] = (0.05, 0.25, 0.50, 0.75, 0.95)


def sequence_ratios(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """The sequence ratios ``s_i`` (Eq. 7) of the responses that have tokens, detached float32 [N_valid].

    For histogram loggers. Selecting the valid rows needs their count, so unlike the rest of this module this
    synchronises with the device once. Above ``log s = 20`` the value follows ``exp_with_linear_tail``.
    """
    valid = (mask != 0).any(dim=1)  # [N]
    ratio = exp_with_linear_tail(sequence_log_ratio(logprobs.detach(), old_logprobs.detach(), mask))  # [N]
    return ratio[valid].detach().float()  # [N_valid]


def length_bucket_edges(max_new_tokens: int, buckets: int = 4) -> list[int]:
    """Edges that split response lengths ``1..max_new_tokens`` into ``buckets`` buckets of (nearly) equal width.

    Edge ``k`` is ``1 + k * max_new_tokens // buckets`` for ``k = 1..buckets-1``, so the buckets are
    ``[1, e_0), [e_0, e_1), ..., [e_last, inf)``; e.g. ``(1024, 4) -> [257, 513, 769]`` (lengths 1-256,
    257-512, 513-768, 769-1024). Edges that would leave a bucket empty (for ``max_new_tokens < buckets``)
    are dropped, so fewer buckets result; ``buckets = 1`` gives ``[]`` (no length split).
    """
    if int(max_new_tokens) < 1 or int(buckets) < 1:
        raise ValueError(f"max_new_tokens and buckets must be >= 1, got {max_new_tokens!r} and {buckets!r}")
    edges = (1 + k * int(max_new_tokens) // int(buckets) for k in range(1, int(buckets)))
    return sorted({edge for edge in edges if edge > 1})


def _validate_edges(length_edges: Sequence[int]) -> list[int]:
    edges = [int(edge) for edge in length_edges]
    if any(edge != raw for edge, raw in zip(edges, length_edges)) or (edges and edges[0] < 2):
        raise ValueError(f"length_edges must be integers >= 2, got {list(length_edges)!r}")
    if any(lower >= upper for lower, upper in zip(edges, edges[1:])):
        raise ValueError(f"length_edges must be strictly increasing, got {edges!r}")
    return edges


def _clipped_token_counts(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, token_mask: Tensor, eps_low: float,
    eps_high: float, ratio_level: RatioLevel, seq_ratio: Tensor,
) -> tuple[Tensor, Tensor]:
    """Per response, the number of tokens whose gradient clipping removes, on the low and the high side.
    ``advantages`` [N], or [N, T] per token (then each token's sign decides, also under one sequence ratio)."""
    lengths = token_mask.sum(dim=1).float()  # [N]
    per_token = advantages.dim() == 2
    if ratio_level == "sequence" and not per_token:  # a response is clipped as a unit: all its tokens or none
        _, low, high = clipped_surrogate(seq_ratio, advantages, eps_low, eps_high)  # [N] each
        return low.float() * lengths, high.float() * lengths  # [N] each
    if ratio_level == "sequence":
        ratio = seq_ratio.unsqueeze(1)  # [N, 1]
    else:
        ratio = exp_with_linear_tail(token_log_ratio(logprobs, old_logprobs, token_mask))  # [N, T]
    _, low, high = clipped_surrogate(ratio, advantages if per_token else advantages.unsqueeze(1), eps_low, eps_high)
    return (low & token_mask).sum(dim=1).float(), (high & token_mask).sum(dim=1).float()  # [N] each


def _ratio_quantiles(log_ratio: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """Quantiles of ``s_i`` and of ``|log s_i|`` over valid responses (1 and 0 when there are none)."""
    ratio = exp_with_linear_tail(log_ratio)  # [N]
    nan = torch.full((1,), float("nan"), dtype=torch.float32, device=ratio.device)  # [1]
    # Invalid entries become NaN, which nanquantile skips; the NaN sentinel keeps an N = 0 batch non-empty.
    masked_ratio = torch.cat([torch.where(valid, ratio, nan), nan])  # [N + 1]
    abs_log = log_ratio.abs()  # [N]
    masked_abs_log = torch.cat([torch.where(valid, abs_log, nan), nan])  # [N + 1]
    # A tensor q on the data's device: torch.quantile checks a CPU q only, so this never synchronises.
    q_ratio = torch.tensor(SEQ_RATIO_QUANTILES, dtype=torch.float32, device=ratio.device)  # [5]
    q_abs = torch.tensor((0.5, 0.95), dtype=torch.float32, device=ratio.device)  # [2]
    any_valid = valid.any()  # []
    ratio_q = torch.where(any_valid, torch.nanquantile(masked_ratio, q_ratio), 1.0)  # [5]
    abs_q = torch.where(any_valid, torch.nanquantile(masked_abs_log, q_abs), 0.0)  # [2]
    zero = torch.zeros(1, dtype=torch.float32, device=ratio.device)  # [1]
    stats = {f"seq_ratio_p{round(q * 100):02d}": ratio_q[k] for k, q in enumerate(SEQ_RATIO_QUANTILES)}
    stats["abs_log_seq_ratio_p50"] = abs_q[0]
    stats["abs_log_seq_ratio_p95"] = abs_q[1]
    stats["abs_log_seq_ratio_max"] = torch.cat([torch.where(valid, abs_log, 0.0), zero]).amax()  # []
    return stats


def _length_bucket_stats(lengths: Tensor, clipped_tokens: Tensor, edges: list[int]) -> dict[str, Tensor]:
    """Token-weighted clip fraction of the responses in each length bucket (0 for an empty bucket)."""
    if not edges:
        return {}
    boundaries = torch.tensor(edges, dtype=lengths.dtype, device=lengths.device)  # [K]
    # right=True: bucket k holds edges[k-1] <= length < edges[k]; bucket 0 starts at 1 (empty rows are masked).
    bucket = torch.bucketize(lengths, boundaries, right=True)  # [N], in 0..K
    members = (bucket.unsqueeze(1) == torch.arange(len(edges) + 1, device=lengths.device)) & (
        lengths > 0
    ).unsqueeze(1)  # [N, K + 1]
    tokens = (members * lengths.float().unsqueeze(1)).sum(dim=0)  # [K + 1]
    clipped = (members * clipped_tokens.unsqueeze(1)).sum(dim=0)  # [K + 1]
    fractions = clipped / tokens.clamp(min=1.0)  # [K + 1]
    names = [str(edge) for edge in [1, *edges]] + ["inf"]
    return {f"clip_frac_len_{names[k]}_{names[k + 1]}": fractions[k] for k in range(len(edges) + 1)}


def by_lag(values: Tensor, weights: Tensor, lags: Tensor, name: str) -> dict[str, Tensor]:
    """``<name>_lag_<k>``: the ``weights``-weighted mean of ``values`` [N] over the responses whose policy lag
    (asynchronous rollouts, [N] int) is k, for each k present among responses of positive weight."""
    out = {}
    for k in sorted(set(lags[weights > 0].tolist())):
        member = (lags == k) & (weights > 0)  # [N]
        out[f"{name}_lag_{k}"] = (values * weights)[member].sum() / weights[member].sum()
    return {key: value.detach().float() for key, value in out.items()}


@torch.no_grad()
def ratio_diagnostics(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    ratio_level: RatioLevel,
    length_edges: Sequence[int] = (),
    lags: Tensor | None = None,
) -> dict[str, Tensor]:
    """Clip fractions per response and per length bucket, the spread of ``s_i``, and KL(pi_old || pi_theta).

    Args:
        logprobs, old_logprobs, mask: [N, T]; mask nonzero on response tokens (bool, int or float).
        advantages: [N] one advantage per response (Eq. 6), or [N, T] one per token (per-turn advantages).
        eps_low, eps_high: the objective's clip range ``[1 - eps_low, 1 + eps_high]``.
        ratio_level: ``"sequence"`` (GSPO, GSPO-token: ``s_i`` of Eq. 7 clipped per response) or ``"token"``
            (GRPO and variants: ``w_i,t`` of Eq. 2 clipped per token). Decides only the clip fractions.
        length_edges: response-length bucket edges in tokens (see ``length_bucket_edges``); none -> no buckets.
        lags: [N] int, each response's policy lag (asynchronous rollouts), or None.

    Returns detached float32 scalars:
        ``clip_frac_resp[_low|_high]``: each valid response weighs once. "sequence": the fraction of responses
            clipped (low: A < 0 and s < 1 - eps_low; high: A > 0 and s > 1 + eps_high). "token": the mean over
            responses of their fraction of clipped tokens. Healthy GSPO with the paper's eps (3e-4/4e-4):
            about 0.1-0.2, like figure 2's token-weighted 0.15; GRPO with 0.2/0.27: about 1e-3. A gap to the
            token-weighted ``clip_frac`` means clipping hits long or short responses more.
        ``seq_ratio_p05/p25/p50/p75/p95``: quantiles of ``s_i`` over valid responses (always the sequence ratio,
            also for token runs, so that runs compare). Exactly 1 on the first minibatch of a rollout round;
            healthy GSPO stays within about 1e-3 of 1 and roughly symmetric around it.
        ``abs_log_seq_ratio_p50/p95/max``: of ``|log s_i|``; a max far above p95 flags a response whose
            likelihood moved a lot (e.g. an inference/training mismatch or an MoE routing shift).
        ``clip_frac_len_<lo>_<hi>``: token-weighted clip fraction of the responses with ``lo <= |y_i| < hi``
            ("sequence": a clipped response counts all its tokens; "token": its clipped tokens).
        ``clip_frac_lag_<k>``: with ``lags``, the same for the responses of lag k (each lag present).
        ``kl_old_theta``: mean over response tokens of the k3 estimate ``(r - 1) - log r >= 0``,
            ``r = pi_theta / pi_old``, of KL(pi_old || pi_theta) (tokens are sampled from pi_old). 0 on the
            first minibatch of a round, small positive values growing over its later minibatches; a value that
            keeps rising from round to round means each round moves the policy further from pi_old.
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {', '.join(RATIO_LEVELS)}, got {ratio_level!r}")
    validate_shapes(logprobs, old_logprobs, advantages, mask, per_token_advantages=True)
    edges = _validate_edges(length_edges)
    logprobs, old_logprobs = logprobs.detach(), old_logprobs.detach()
    token_mask = mask != 0  # [N, T]
    lengths = token_mask.sum(dim=1)  # [N], int64
    valid = lengths > 0  # [N]
    log_ratio = sequence_log_ratio(logprobs, old_logprobs, mask)  # [N], 0 for empty responses
    low_tokens, high_tokens = _clipped_token_counts(
        logprobs, old_logprobs, advantages.detach().float(), token_mask, eps_low, eps_high, ratio_level,
        exp_with_linear_tail(log_ratio),
    )  # [N] each
    denominator = lengths.float().clamp(min=1.0)  # [N]
    low = mean_over_valid(low_tokens / denominator, valid)  # []
    high = mean_over_valid(high_tokens / denominator, valid)  # []
    stats = {"clip_frac_resp": low + high, "clip_frac_resp_low": low, "clip_frac_resp_high": high}
    stats.update(_ratio_quantiles(log_ratio, valid))
    stats.update(_length_bucket_stats(lengths, low_tokens + high_tokens, edges))
    if lags is not None:  # token-weighted: clipped tokens over tokens, per lag
        stats.update(by_lag((low_tokens + high_tokens) / denominator, lengths.float(), lags.to(lengths.device),
                            "clip_frac"))  # fmt: skip
    # k3 of KL(pi_old || pi_theta) = expm1(x) - x with x = log r; linear above x = 20, so huge x stays finite.
    kl = k3_from_log_ratio(token_log_ratio(logprobs, old_logprobs, token_mask))  # [N, T], 0 on padding
    stats["kl_old_theta"] = mean_over_valid(kl, token_mask)
    return {name: value.detach().float() for name, value in stats.items()}
