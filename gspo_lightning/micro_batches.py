"""How one minibatch's log-prob passes lay out its sequences: packed or padded, all at once or by token budget.

A token budget (``model.micro_batch_tokens``) cuts a minibatch into micro-batches of at most that many tokens,
balanced by cost, so that the activations of one micro-batch, not of the whole minibatch, exist at a time. The
objective still sees the whole minibatch: the micro-batches' log-probs are put back into one [n, R] tensor
before the loss, so every normaliser (GSPO's 1 / N over responses, DAPO's token mean) is the minibatch's and
the update is the single-batch update. Under gradient, every micro-batch but the last runs checkpointed
(``torch.utils.checkpoint``): its forward is recomputed in backward, one micro-batch at a time.

Pure functions of lengths: no model, no state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class BatchLayout:
    """How a minibatch's forwards (pi_old's, the reference's, pi_theta's) run over its sequences.

    Attributes:
        packing: the sequences packed end to end (:mod:`gspo_lightning.packing`) instead of the padded
            [n, prompt + response] rectangle.
        micro_batch_tokens: at most this many tokens per forward (real tokens when packed; rows x the padded
            width otherwise), or None for the whole minibatch in one forward.
    """

    packing: bool = False
    micro_batch_tokens: int | None = None

    def costs(self, attention_mask: Tensor) -> list[int]:
        """Tokens each sequence of an [n, L] minibatch costs a forward: its real tokens packed, L padded."""
        if self.packing:
            return attention_mask.sum(-1).tolist()
        return [attention_mask.shape[1]] * attention_mask.shape[0]


def plan_micro_batches(costs: list[int], budget: int) -> list[list[int]]:
    """Sequences (by index) per micro-batch: each micro-batch's costs sum to at most ``budget``, as few
    micro-batches as the longest-first greedy finds, and their totals balanced (each sequence, longest first,
    goes to the micro-batch with the least so far).

    Deterministic (ties by index), so pi_old's pass and pi_theta's pass cut a minibatch the same way and run
    the same forwards: the first minibatch of a round then has ratio exactly 1.

    Raises:
        ValueError: a sequence costs more than ``budget`` (naming both numbers).
    """
    if budget < 1:
        raise ValueError(f"model.micro_batch_tokens must be >= 1, got {budget}")
    if not costs:
        return []
    longest = max(costs)
    if longest > budget:
        raise ValueError(
            f"model.micro_batch_tokens={budget} is smaller than a sequence of this minibatch ({longest} tokens, "
            f"prompt and response): set it to at least {longest}; a sequence is never split across micro-batches"
        )
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    count = math.ceil(sum(costs) / budget)
    while True:
        groups = _longest_first(costs, order, budget, count)
        if groups is not None:
            return sorted((sorted(group) for group in groups), key=lambda group: group[0])
        count += 1


def _longest_first(costs: list[int], order: list[int], budget: int, count: int) -> list[list[int]] | None:
    """``order``'s sequences into ``count`` micro-batches, each to the least filled; None if one overflows."""
    groups: list[list[int]] = [[] for _ in range(count)]
    totals = [0] * count
    for index in order:
        target = min(range(count), key=lambda g: (totals[g], g))
        if totals[target] + costs[index] > budget:
            return None
        groups[target].append(index)
        totals[target] += costs[index]
    return [group for group in groups if group]
