"""PromptStream: repetition per rollout, endless epochs, rank sharding and exact resume."""

from __future__ import annotations

import itertools

import datasets
import pytest

from gspo_lightning.data import PromptFormatter
from gspo_lightning.data.stream import PromptStream
from gspo_lightning.rollout.types import PromptBatch


def rows(count: int) -> datasets.Dataset:
    return datasets.Dataset.from_list([{"question": f"q{i}", "answer": str(i)} for i in range(count)])


def stream(count: int = 20, prompts: int = 4, minibatches: int = 2, **kwargs: int) -> PromptStream:
    return PromptStream(rows(count), PromptFormatter("{question}?"), prompts, minibatches, columns=["answer"], **kwargs)


def take(source: PromptStream, count: int) -> list[PromptBatch]:
    return list(itertools.islice(iter(source), count))


def key(batch: PromptBatch) -> tuple[int, int, list[str]]:
    return batch.rollout_index, batch.minibatch_index, list(batch.prompts)


def test_each_rollout_batch_is_served_k_times() -> None:
    batches = take(stream(prompts=4, minibatches=3), 9)
    for rollout in range(3):
        served = batches[3 * rollout : 3 * rollout + 3]
        assert [b.minibatch_index for b in served] == [0, 1, 2]
        assert {b.rollout_index for b in served} == {rollout} and {b.num_minibatches for b in served} == {3}
        assert all(b.prompts == served[0].prompts and len(b) == 4 for b in served)
        assert len({id(b) for b in served}) == 3 and served[0].prompts is not served[1].prompts
    first = batches[0]
    assert first.columns["answer"] == [p[1:-1] for p in first.prompts]  # columns line up with prompts
    assert all(p.endswith("?") for p in first.prompts) and set(first.columns) == {"answer"}


def test_endless_and_each_epoch_is_a_fresh_permutation_of_all_rows() -> None:
    # 20 rows, P=4: 5 rollouts per epoch; take 6 epochs of rollouts (K=1 to keep it short).
    batches = take(stream(count=20, prompts=4, minibatches=1), 30)
    assert [b.rollout_index for b in batches] == list(range(30))
    epochs = [sum((b.prompts for b in batches[5 * e : 5 * e + 5]), []) for e in range(6)]
    assert all(sorted(epoch) == sorted(f"q{i}?" for i in range(20)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 6  # the order changes every epoch


def test_remainder_rows_are_skipped_each_epoch() -> None:
    batches = take(stream(count=10, prompts=4, minibatches=1), 4)  # 2 whole rollouts per epoch
    assert all(len(b) == 4 for b in batches)
    assert len(set(batches[0].prompts + batches[1].prompts)) == 8


def test_ranks_get_disjoint_prompts_covering_the_epoch() -> None:
    per_rank = [take(stream(count=24, prompts=4, minibatches=2, rank=r, world_size=2), 6) for r in range(2)]
    seen = [set(sum((b.prompts for b in batches), [])) for batches in per_rank]
    assert len(seen[0]) == len(seen[1]) == 12
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == {f"q{i}?" for i in range(24)}


def test_same_seed_same_order_other_seed_other_order() -> None:
    assert [key(b) for b in take(stream(seed=5), 6)] == [key(b) for b in take(stream(seed=5), 6)]
    assert [key(b) for b in take(stream(seed=5), 6)] != [key(b) for b in take(stream(seed=6), 6)]


def test_state_round_trip_mid_round_continues_exactly() -> None:
    reference = [key(b) for b in take(stream(count=12, minibatches=4), 40)]  # spans several epochs
    interrupted = stream(count=12, minibatches=4)
    iterator = iter(interrupted)
    first = [key(next(iterator)) for _ in range(5)]  # stop inside the second rollout (item 5 = r1, k1)
    state = interrupted.state_dict()
    assert (state["rollout_index"], state["minibatch_index"], state["epoch"], state["position"]) == (1, 1, 0, 4)
    resumed = stream(count=12, minibatches=4)
    resumed.load_state_dict(state)
    assert first + [key(b) for b in take(resumed, 35)] == reference


def test_state_after_a_batch_points_to_the_next_item() -> None:
    source = stream(count=12, minibatches=4)
    batches = take(source, 12)
    for position, batch in enumerate(batches[:-1]):
        restored = stream(count=12, minibatches=4)
        restored.load_state_dict(source.state_after(batch))
        assert key(next(iter(restored))) == key(batches[position + 1])


def test_share_smaller_than_prompts_per_rollout_fails() -> None:
    with pytest.raises(ValueError, match="each of the 2 rank\\(s\\) gets 5 of the 11 training rows"):
        stream(count=11, prompts=6, world_size=2)


def test_resuming_under_another_layout_fails() -> None:
    state = stream(count=20).state_dict()
    with pytest.raises(ValueError, match="minibatches_per_rollout \\(saved 2, now 3\\)"):
        stream(count=20, minibatches=3).load_state_dict(state)
    with pytest.raises(ValueError, match="world_size"):
        stream(count=20, world_size=2).load_state_dict(state)
