"""The unbiased pass@k estimator (Chen et al. 2021) and its torchmetrics accumulator."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
from torchmetrics.utilities.data import dim_zero_sum

from gspo_lightning.metrics import PassAtK, pass_at_k


def _exact(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k) with exact integers (math.comb is 0 when k > n - c)."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # c / n
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 2, 4, 1.0),  # n - c = 3 < k: every 4-subset holds a correct sample
        (5, 0, 3, 0.0),
        (5, 5, 5, 1.0),
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (10, 1, 10, 1.0),
    ],
)
def test_hand_computed_values(n, c, k, expected):
    value = pass_at_k(torch.tensor([n]), torch.tensor([c]), k)
    assert value.dtype == torch.float64 and value.shape == (1,)
    assert value.item() == pytest.approx(expected, abs=1e-12)


def test_matches_the_average_over_all_k_subsets():
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                brute_force = sum(any(subset) for subset in subsets) / len(subsets)
                assert pass_at_k(torch.tensor([n]), torch.tensor([c]), k).item() == pytest.approx(
                    brute_force, abs=1e-12
                )


def test_vectorised_over_problems_with_different_n_and_a_shared_scalar_n():
    n = torch.tensor([5, 8, 3, 10])  # [P]
    c = torch.tensor([2, 0, 3, 7])  # [P]
    expected = [_exact(5, 2, 2), 0.0, 1.0, _exact(10, 7, 2)]
    assert pass_at_k(n, c, 2).tolist() == pytest.approx(expected, abs=1e-12)
    shared = pass_at_k(6, torch.tensor([0, 1, 6]), 3)
    assert shared.tolist() == pytest.approx([0.0, _exact(6, 1, 3), 1.0], abs=1e-12)


@pytest.mark.parametrize("n", [200, 2000])
def test_large_n_is_finite_and_exact(n):
    # C(2000, 1000) ~ 1e600 overflows float64; the product form does not need it.
    c = torch.tensor([0, 1, 7, n // 4, n // 2, n - 1])
    for k in (1, 10, 100, n // 2):
        values = pass_at_k(torch.full_like(c, n), c, k)
        assert bool(values.isfinite().all()) and bool(((values >= 0) & (values <= 1)).all())
        expected = [_exact(n, int(ci), k) for ci in c]
        assert values.tolist() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_integral_float_counts_are_accepted():
    assert pass_at_k(torch.tensor([5.0]), torch.tensor([2.0]), 2).item() == pytest.approx(0.7)


def test_empty_input_gives_an_empty_result():
    assert pass_at_k(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), 3).shape == (0,)


@pytest.mark.parametrize(
    ("n", "c", "k", "match"),
    [
        ([5, 3], [1, 1], 4, r"pass@4 needs at least k=4 samples per problem, but problem 1 has n=3"),
        ([5], [6], 1, r"problem 0 has c=6 > n=5"),
        ([5], [-1], 1, r"num_correct \(c\) must be >= 0"),
        ([-5], [0], 1, r"num_samples \(n\) must be >= 0"),
        ([5], [1], 0, r"integer k >= 1, got k=0"),
        ([5], [1], 1.5, r"integer k >= 1, got k=1.5"),
        ([5.5], [1], 1, r"num_samples \(n\) must be whole numbers"),
    ],
)
def test_errors(n, c, k, match):
    with pytest.raises(ValueError, match=match):
        pass_at_k(torch.tensor(n), torch.tensor(c), k)


def test_metric_accumulates_and_averages_over_problems():
    metric = PassAtK([1, 2, 5])
    metric.update(torch.tensor([2, 0]), 5)
    metric.update(torch.tensor([5]), torch.tensor([5]))
    values = metric.compute()
    assert list(values) == ["pass@1", "pass@2", "pass@5"]
    assert values["pass@1"].item() == pytest.approx((0.4 + 0.0 + 1.0) / 3)
    assert values["pass@2"].item() == pytest.approx((0.7 + 0.0 + 1.0) / 3)
    assert values["pass@5"].item() == pytest.approx((1.0 + 0.0 + 1.0) / 3)
    metric.reset()
    metric.update(torch.tensor([1]), 5)
    assert metric.compute()["pass@1"].item() == pytest.approx(0.2)


def test_metric_states_reduce_by_sum():
    # What DDP does to the states of two ranks that each scored their own problems.
    assert PassAtK([1, 2])._reductions == {"estimate_sum": dim_zero_sum, "num_problems": dim_zero_sum}
    one, two = PassAtK([1, 2]), PassAtK([1, 2])
    one.update(torch.tensor([2]), 5)
    two.update(torch.tensor([0, 5]), 5)
    one.merge_state(two)
    assert one.compute()["pass@2"].item() == pytest.approx((0.7 + 0.0 + 1.0) / 3)


def test_metric_names_k_and_n_when_a_problem_has_too_few_samples():
    metric = PassAtK([1, 8])
    with pytest.raises(ValueError, match=r"pass@8 needs at least k=8 samples per problem, but problem 0 has n=4"):
        metric.update(torch.tensor([1, 2]), 4)


@pytest.mark.parametrize(
    ("k_values", "match"), [([], "at least one k"), ([1, 1], "distinct"), ([0], "k >= 1"), ([2, True], "k >= 1")]
)
def test_metric_rejects_bad_k_values(k_values, match):
    with pytest.raises(ValueError, match=match):
        PassAtK(k_values)


def test_metric_rejects_a_non_vector_of_counts():
    with pytest.raises(ValueError, match=r"num_correct must be 1-D"):
        PassAtK([1]).update(torch.tensor([[1, 2]]), 4)
