"""pass@k: the probability that at least one of k samples solves a problem, estimated without bias from n >= k.

Drawing only k samples per problem and checking whether one is correct gives a high-variance estimate. Chen et
al. 2021 ("Evaluating Large Language Models Trained on Code", the Codex paper, Eq. 1) draw n >= k samples, count
the c correct ones, and average, over problems, the chance that a random k-subset of the n holds a correct one:

    pass@k = E_problems[ 1 - C(n - c, k) / C(n, k) ]

The binomial coefficients overflow for realistic n (C(1000, 500) ~ 1e299), so, as in the paper's code, the ratio
is computed as the product prod_{i = n-c+1}^{n} (1 - k / i), in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric


def _check_k(k: Any) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"pass@k needs an integer k >= 1, got k={k!r}")


def _whole(values: Tensor, name: str) -> Tensor:
    """``values`` as int64, refusing fractions and negatives (counts of samples)."""
    if values.is_floating_point() and not bool((values == values.round()).all()):
        raise ValueError(f"{name} must be whole numbers, got {values.tolist()}")
    counts = values.long()
    if bool((counts < 0).any()):
        raise ValueError(f"{name} must be >= 0, got {counts.tolist()}")
    return counts


def pass_at_k(num_samples: Tensor | int, num_correct: Tensor | int, k: int) -> Tensor:
    """Unbiased pass@k of each problem, ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021), in float64.

    Args:
        num_samples: n, samples drawn per problem, [P] (or a scalar shared by every problem).
        num_correct: c, how many of them are correct, [P] (or a scalar).
        k: the k of pass@k; every problem needs n >= k.

    Returns:
        [P] float64, each in [0, 1]: 0 when c = 0, 1 when n - c < k (every k-subset holds a correct sample),
        c / n for k = 1.
    """
    _check_k(k)
    c = torch.as_tensor(num_correct)
    n, c = torch.broadcast_tensors(torch.as_tensor(num_samples, device=c.device), c)
    n, c = _whole(n, "num_samples (n)"), _whole(c, "num_correct (c)")  # [P], [P]
    if bool((c > n).any()):
        row = int((c > n).nonzero()[0, 0])
        raise ValueError(f"num_correct exceeds num_samples: problem {row} has c={int(c[row])} > n={int(n[row])}")
    if bool((n < k).any()):
        row = int((n < k).nonzero()[0, 0])
        raise ValueError(f"pass@{k} needs at least k={k} samples per problem, but problem {row} has n={int(n[row])}")
    if n.numel() == 0:
        return torch.zeros(n.shape, dtype=torch.float64, device=n.device)
    i = torch.arange(1, int(n.max()) + 1, dtype=torch.float64, device=n.device)  # [M], M = max n
    in_range = (i > (n - c).unsqueeze(-1)) & (i <= n.unsqueeze(-1))  # [P, M]: i in (n - c, n]
    # C(n-c, k) / C(n, k) = prod over i in (n-c, n] of (1 - k/i). Factors with i <= k are <= 0, and appear
    # exactly when n - c < k; those problems are set to 1 below.
    factors = torch.where(in_range, 1.0 - k / i, torch.ones_like(i))  # [P, M]
    estimate = 1.0 - factors.prod(-1)  # [P]
    return torch.where(n - c < k, torch.ones_like(estimate), estimate)  # [P]


class PassAtK(Metric):
    """Mean unbiased pass@k over problems, for several k at once (Chen et al. 2021).

    ``update`` adds each problem's estimate to a running sum and counts the problems; both states reduce across
    processes with a sum, so under DDP every rank can score its own share of problems. ``compute`` returns
    ``{"pass@<k>": mean}`` for each k, as float64 scalars.

    Args:
        k_values: the k's to estimate, each >= 1 and distinct; every problem needs at least max(k) samples.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    estimate_sum: Tensor
    num_problems: Tensor

    def __init__(self, k_values: Sequence[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        k_values = list(k_values)
        if not k_values:
            raise ValueError("PassAtK needs at least one k in k_values")
        for k in k_values:
            _check_k(k)
        if len(set(k_values)) != len(k_values):
            raise ValueError(f"PassAtK k_values must be distinct, got {k_values}")
        self.k_values = tuple(k_values)
        self.add_state("estimate_sum", default=torch.zeros(len(k_values), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_problems", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, num_correct: Tensor, num_samples: Tensor | int) -> None:
        """Add problems: ``num_correct`` [P] correct samples out of ``num_samples`` ([P] or one int for all)."""
        num_correct = torch.as_tensor(num_correct)
        if num_correct.dim() != 1:
            raise ValueError(f"num_correct must be 1-D [problems], got shape {tuple(num_correct.shape)}")
        estimates = torch.stack([pass_at_k(num_samples, num_correct, k) for k in self.k_values])  # [len(k), P]
        self.estimate_sum += estimates.sum(-1).to(self.estimate_sum.device)
        self.num_problems += num_correct.numel()

    def compute(self) -> dict[str, Tensor]:
        """``{"pass@<k>": mean estimate over every problem seen}``; NaN before any problem was added."""
        means = self.estimate_sum / self.num_problems  # [len(k)]
        return {f"pass@{k}": means[index] for index, k in enumerate(self.k_values)}
