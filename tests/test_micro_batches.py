"""Token-budget micro-batches: the plan by hand, the budget's errors, and the micro-batched passes against the
whole minibatch's (loss and every gradient, for every objective, packed and padded) in float64."""

from __future__ import annotations

import pytest
import torch

from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.micro_batches import BatchLayout, plan_micro_batches
from gspo_lightning.objectives import OBJECTIVES
from tests.test_packing import PACKED, PADDED, _scores, _uneven_batch


def test_the_plan_by_hand():
    # 9 + 8 + 7 + 4 + 3 + 1 = 32 tokens in budgets of 12: three micro-batches, longest first to the least filled
    plan = plan_micro_batches([4, 9, 1, 7, 3, 8], 12)
    assert plan == [[0, 3], [1, 2], [4, 5]]  # 9 | 8 | 7, then 4 -> the 7's, 3 -> the 8's, 1 -> the 9's
    assert [sum([4, 9, 1, 7, 3, 8][i] for i in group) for group in plan] == [11, 10, 11]
    assert plan_micro_batches([5, 5, 5], 15) == [[0, 1, 2]]
    assert plan_micro_batches([6, 6, 6], 10) == [[0], [1], [2]]  # 18 / 10 -> 2 tried first, then 3
    assert plan_micro_batches([], 10) == []


def test_a_budget_below_the_longest_sequence_names_both_numbers():
    with pytest.raises(ValueError, match=r"model.micro_batch_tokens=10 is smaller than a sequence of this minibatch "
                                         r"\(13 tokens.*at least 13"):  # fmt: skip
        plan_micro_batches([4, 13, 2], 10)
    with pytest.raises(ValueError, match="model.micro_batch_tokens must be >= 1, got 0"):
        plan_micro_batches([1], 0)


def test_costs_are_real_tokens_packed_and_the_padded_width_otherwise():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    assert BatchLayout(packing=True).costs(mask) == [3, 2]
    assert BatchLayout().costs(mask) == [4, 4]


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
@pytest.mark.parametrize("base", [PADDED, PACKED], ids=["padded", "packed"])
def test_every_objective_micro_batched_equals_one_batch_in_float64(float64_policy, name, base):
    """The registry, walked. Six sequences of 7-12 tokens (55 in all; 15 wide padded): a budget of 20 packed
    tokens or of two padded rows cuts three micro-batches; two of them run again in backward (checkpointed)."""
    ids, mask, r = _uneven_batch(float64_policy.config.vocab_size, seed=3)
    whole, whole_loss, whole_grads = _scores(float64_policy, ids, mask, r, base, 1024, name)
    budget = BatchLayout(base.packing, 20 if base.packing else 2 * ids.shape[1])
    assert len(plan_micro_batches(budget.costs(mask), budget.micro_batch_tokens)) == 3
    forwards: list[int] = []
    hook = float64_policy.model.layers[0].register_forward_hook(lambda m, a, o: forwards.append(1))
    try:
        cut, cut_loss, cut_grads = _scores(float64_policy, ids, mask, r, budget, 1024, name)
    finally:
        hook.remove()
    assert len(forwards) == 3 + 2
    response_mask = mask[:, -r:].bool()
    torch.testing.assert_close(cut.logprobs[response_mask], whole.logprobs[response_mask], atol=1e-10, rtol=0)
    torch.testing.assert_close(cut.entropy[response_mask], whole.entropy[response_mask], atol=1e-10, rtol=0)
    torch.testing.assert_close(cut_loss, whole_loss, atol=1e-10, rtol=0)
    assert any(grad.abs().sum() > 0 for grad in cut_grads.values())
    # 1e-6, not float64's rounding: the log-probs are float32 and the micro-batches but the last recompute the
    # head's gradient where the whole batch takes the prediction (held to 1e-5 of the arriving gradient)
    for parameter, grad in whole_grads.items():
        torch.testing.assert_close(cut_grads[parameter], grad, atol=1e-6, rtol=0, msg=parameter)


def test_without_gradient_nothing_is_recomputed(float64_policy):
    ids, mask, r = _uneven_batch(float64_policy.config.vocab_size)
    forwards: list[int] = []
    hook = float64_policy.model.layers[0].register_forward_hook(lambda m, a, o: forwards.append(1))
    try:
        with torch.no_grad():
            response_logprobs(float64_policy, ids, mask, r, layout=BatchLayout(True, 20))
    finally:
        hook.remove()
    assert len(forwards) == 3


class _Prompts:
    """A data module's prompt listing (``prompt_chunks``), as the fit-start checks read it."""

    def __init__(self, prompts: list[str]) -> None:
        self.prompts = prompts

    def prompt_chunks(self, split: str = "train"):
        yield 0, self.prompts


def test_a_budget_the_data_cannot_fit_is_refused_at_fit_start(tokenizer):
    from gspo_lightning.rollout.checks import check_micro_batch_budget
    from gspo_lightning.rollout.data_contract import DataSide
    from gspo_lightning.validation import SettingError

    data = DataSide(_Prompts(["1+1=", "123+456="]))  # 8 characters: 8 tokens (character tokenizer)
    check_micro_batch_budget(data, tokenizer, 16, 8, context=None)  # 8 + 8 fits
    check_micro_batch_budget(data, tokenizer, None, 8, context=None)  # no budget: nothing to check
    check_micro_batch_budget(data, tokenizer, 12, 8, context=12)  # the context caps a sequence at 12
    with pytest.raises(SettingError, match=r"model.micro_batch_tokens=15 is smaller than the longest sequence the "
                                           r"training data can make: its longest prompt \(8 tokens\) with "
                                           r"model.max_new_tokens=8 is 16 tokens; set model.micro_batch_tokens to "
                                           r"at least 16"):  # fmt: skip
        check_micro_batch_budget(data, tokenizer, 15, 8, context=None)
