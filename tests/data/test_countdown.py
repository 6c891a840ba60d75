"""countdown_problems and CountdownTask."""

from __future__ import annotations

from fractions import Fraction
from itertools import combinations

import pytest

from gspo_lightning.data.countdown import CountdownTask, countdown_problems, is_heldout


def solvable(numbers: list[int], target: int) -> bool:
    """Brute force: can some subset of ``numbers`` (each used once) reach ``target`` with + - * /?"""

    def reachable(values: tuple[Fraction, ...]) -> set[Fraction]:
        found = set(values)
        for i, j in combinations(range(len(values)), 2):
            a, b = values[i], values[j]
            rest = tuple(v for k, v in enumerate(values) if k not in (i, j))
            results = {a + b, a - b, b - a, a * b}
            if b:
                results.add(a / b)
            if a:
                results.add(b / a)
            for result in results:
                found |= reachable((*rest, result))
        return found

    return Fraction(target) in reachable(tuple(Fraction(n) for n in numbers))


def test_deterministic_and_seed_dependent() -> None:
    first = list(countdown_problems(20, seed=3))
    assert first == list(countdown_problems(20, seed=3))
    assert first != list(countdown_problems(20, seed=4))
    assert len(first) == 20
    for row in first:
        assert set(row) == {"numbers", "target"}
        numbers = [int(n) for n in row["numbers"].split()]
        assert len(numbers) == 4 and all(1 <= n <= 100 for n in numbers)
        assert int(row["target"]) > 0


def test_heldout_split_is_disjoint() -> None:
    train = list(countdown_problems(2000, seed=0))
    held = list(countdown_problems(100, seed=0, heldout=True))
    assert all(not is_heldout(r["numbers"], r["target"]) for r in train)
    assert all(is_heldout(r["numbers"], r["target"]) for r in held)
    key = lambda rows: {(r["numbers"], r["target"]) for r in rows}  # noqa: E731
    assert not key(train) & key(held)
    # A different seed still stays on its side.
    assert not key(countdown_problems(500, seed=7)) & key(held)


@pytest.mark.parametrize(("num_numbers", "max_number"), [(3, 10), (4, 12)])
def test_every_problem_is_solvable(num_numbers: int, max_number: int) -> None:
    for row in countdown_problems(15, num_numbers=num_numbers, max_number=max_number, seed=1):
        assert solvable([int(n) for n in row["numbers"].split()], int(row["target"])), row


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_numbers"):
        next(countdown_problems(1, num_numbers=1))
    with pytest.raises(ValueError, match="max_number"):
        next(countdown_problems(1, max_number=1))
    with pytest.raises(ValueError, match="train_size"):
        CountdownTask(train_size=0)


def test_task_splits() -> None:
    loaded = CountdownTask(num_numbers=3, max_number=20, train_size=50, eval_size=8, seed=2).load()
    assert set(loaded) == {"train", "eval"}
    assert (len(loaded["train"]), len(loaded["eval"])) == (50, 8)
    assert loaded["train"].column_names == ["numbers", "target"]
    train = set(zip(loaded["train"]["numbers"], loaded["train"]["target"]))
    assert not train & set(zip(loaded["eval"]["numbers"], loaded["eval"]["target"]))


def test_demonstrations_are_the_same_problems_with_a_solution_that_reaches_the_target():
    from gspo_lightning.data.countdown import countdown_demonstrations
    from gspo_lightning.rewards.countdown import CountdownAnswer

    demonstrations = list(countdown_demonstrations(300, num_numbers=4, max_number=50, seed=2))
    problems = list(countdown_problems(300, num_numbers=4, max_number=50, seed=2))
    assert [{k: d[k] for k in ("numbers", "target")} for d in demonstrations] == problems
    assert all(CountdownAnswer.score(d["solution"], d["numbers"], d["target"]) == 1.0 for d in demonstrations)
    assert any("(" in d["solution"] for d in demonstrations)  # nested combinations are written with parentheses
