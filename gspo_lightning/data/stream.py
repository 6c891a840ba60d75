"""The endless, rank-sharded, exactly resumable stream of rollout prompt batches.

Item ``i`` of a rank's stream is fully determined by ``i`` and the layout (seed, world size, rollout shape):

    rollout r = i // K, minibatch k = i % K, epoch e = r // R, rollout-in-epoch j = r % R

where K is ``minibatches_per_rollout`` and R the number of whole rollout batches in a rank's share of an
epoch. Each epoch shuffles all rows with a generator seeded by ``(seed, e)``; rank ``q`` of ``W`` takes every
W-th index of the permutation starting at ``q``. The state is therefore just "the next item", which makes
resume exact, and lets the state be computed from any served batch (see ``state_after``).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import datasets
import torch
from torch.utils.data import IterableDataset, get_worker_info

from gspo_lightning.rollout.types import Prompt, PromptBatch
from gspo_lightning.validation import SettingError

# Settings that fix which prompts item i is; a saved state only makes sense under the same ones.
LAYOUT_KEYS = ("seed", "world_size", "num_rows", "prompts_per_rollout", "minibatches_per_rollout")


def make_prompt_batch(
    rows: dict[str, list[Any]],
    formatter: Callable[[dict[str, Any]], Prompt],
    columns: Sequence[str],
    rollout_index: int = 0,
    minibatch_index: int = 0,
    num_minibatches: int = 1,
) -> PromptBatch:
    """Build a fresh ``PromptBatch`` from column-major ``rows`` (as returned by ``Dataset.__getitem__``).

    Everything is newly built or copied, so a consumer may mutate the batch without affecting other batches.
    """
    names = list(rows)
    records = [dict(zip(names, values)) for values in zip(*(rows[name] for name in names))]
    return PromptBatch(
        prompts=[formatter(record) for record in records],
        columns={name: copy.deepcopy(rows[name]) for name in columns},
        rollout_index=rollout_index,
        minibatch_index=minibatch_index,
        num_minibatches=num_minibatches,
    )


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed for one epoch, decorrelated across nearby ``(seed, epoch)`` pairs."""
    digest = hashlib.sha256(f"{seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class PromptStream(IterableDataset):
    """Endless stream of ``PromptBatch`` items: each rollout batch of P prompts is served K times in a row.

    Rows are read from the Arrow-backed data set one rollout batch at a time. Under a multi-worker data
    loader, worker ``w`` of ``n`` serves items ``w, w + n, ...`` so the in-order loader output is unchanged.
    """

    def __init__(
        self,
        dataset: datasets.Dataset,
        formatter: Callable[[dict[str, Any]], Prompt],
        prompts_per_rollout: int,
        minibatches_per_rollout: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        columns: Sequence[str] | None = None,
    ) -> None:
        """
        Args:
            dataset: map-style data set of prompt rows.
            formatter: turns a row (a dict of column values) into a prompt.
            prompts_per_rollout: P, prompts in one rollout batch.
            minibatches_per_rollout: K, times each rollout batch is served (one optimizer step each).
            seed: shuffling seed, shared by all ranks.
            rank: this process' rank (0 .. world_size - 1).
            world_size: number of ranks sharing the data set.
            columns: columns passed along in ``PromptBatch.columns``; all of them when ``None``.
        """
        positive = {
            "prompts_per_rollout": prompts_per_rollout,
            "minibatches_per_rollout": minibatches_per_rollout,
            "world_size": world_size,
        }
        for setting, value in positive.items():
            if value < 1:
                raise SettingError(f"{setting} must be >= 1, got {value}")
        if not 0 <= rank < world_size:
            raise SettingError(f"rank must be in [0, world_size={world_size}), got {rank}")
        # Every rank gets the same share size (the permutation's tail beyond a multiple of world_size is
        # dropped), so all ranks have the same number of rollouts per epoch and stay in step.
        self.rows_per_rank = len(dataset) // world_size
        if self.rows_per_rank < prompts_per_rollout:
            raise SettingError(
                f"each of the {world_size} rank(s) gets {self.rows_per_rank} of the {len(dataset)} training rows, "
                f"fewer than prompts_per_rollout={prompts_per_rollout}; use more data or fewer prompts per rollout"
            )
        self.dataset = dataset
        self.formatter = formatter
        self.prompts_per_rollout = prompts_per_rollout
        self.minibatches_per_rollout = minibatches_per_rollout
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.columns = list(dataset.column_names if columns is None else columns)
        # Whole rollout batches per epoch; the remainder of a rank's share is skipped (differently each epoch).
        self.rollouts_per_epoch = self.rows_per_rank // prompts_per_rollout
        self._next_item = 0
        self._epoch_cache: tuple[int, list[int]] | None = None

    def __iter__(self) -> Iterator[PromptBatch]:
        worker = get_worker_info()
        offset, stride = (0, 1) if worker is None else (worker.id, worker.num_workers)
        item = self._next_item + offset
        cached: tuple[int, dict[str, list[Any]]] | None = None
        while True:
            rollout, minibatch = divmod(item, self.minibatches_per_rollout)
            if cached is None or cached[0] != rollout:
                cached = (rollout, self.dataset[self.rollout_indices(rollout)])
            batch = make_prompt_batch(
                cached[1], self.formatter, self.columns, rollout, minibatch, self.minibatches_per_rollout
            )
            # Advance before yielding: while suspended, the state must already name the next item.
            self._next_item = item + stride
            yield batch
            item += stride

    def rollout_indices(self, rollout: int) -> list[int]:
        """Data set row indices of this rank's rollout batch ``rollout``."""
        epoch, slot = divmod(rollout, self.rollouts_per_epoch)
        start = slot * self.prompts_per_rollout
        return self._epoch_indices(epoch)[start : start + self.prompts_per_rollout]

    def _epoch_indices(self, epoch: int) -> list[int]:
        """This rank's share of the epoch's permutation (cached: an epoch spans many rollouts)."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            permutation = torch.randperm(len(self.dataset), generator=generator).tolist()
            usable = self.rows_per_rank * self.world_size
            self._epoch_cache = (epoch, permutation[self.rank : usable : self.world_size])
        return self._epoch_cache[1]

    # ----- state -----

    def _layout(self) -> dict[str, int]:
        return {
            "seed": self.seed,
            "world_size": self.world_size,
            "num_rows": len(self.dataset),
            "prompts_per_rollout": self.prompts_per_rollout,
            "minibatches_per_rollout": self.minibatches_per_rollout,
        }

    def _state_at(self, item: int) -> dict[str, int]:
        rollout, minibatch = divmod(item, self.minibatches_per_rollout)
        epoch, slot = divmod(rollout, self.rollouts_per_epoch)
        return {
            "epoch": epoch,
            "position": slot * self.prompts_per_rollout,  # offset of the rollout batch in the rank's share
            "rollout_index": rollout,
            "minibatch_index": minibatch,
            **self._layout(),
        }

    def state_dict(self) -> dict[str, int]:
        """The next item to yield. Rank-independent: all ranks advance in step, so rank 0's state serves all."""
        return self._state_at(self._next_item)

    def state_after(self, batch: PromptBatch) -> dict[str, int]:
        """The state in which the item following ``batch`` (a batch this stream served) is next."""
        if batch.num_minibatches != self.minibatches_per_rollout:
            raise ValueError(
                f"batch has num_minibatches={batch.num_minibatches}, but this stream serves "
                f"minibatches_per_rollout={self.minibatches_per_rollout}: it was not served by this stream"
            )
        return self._state_at(batch.rollout_index * self.minibatches_per_rollout + batch.minibatch_index + 1)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a state saved by ``state_dict`` or ``state_after`` under the same layout."""
        changed = [
            f"{key} (saved {state.get(key)}, now {value})"
            for key, value in self._layout().items()
            if state.get(key) != value
        ]
        if changed:
            raise ValueError(
                "cannot resume the prompt stream exactly: settings that decide which prompts come next changed: "
                + ", ".join(changed)
            )
        item = state["rollout_index"] * self.minibatches_per_rollout + state["minibatch_index"]
        if self._state_at(item) != {**state, **self._layout()}:
            raise ValueError(f"inconsistent prompt stream state {state}; expected {self._state_at(item)}")
        self._next_item = item


def replace_seed(stream: PromptStream, seed: int, minibatches_per_rollout: int | None = None) -> PromptStream:
    """A stream over the same rows and ranks with another shuffle (and optionally another K), from its start."""
    return PromptStream(
        stream.dataset,
        stream.formatter,
        stream.prompts_per_rollout,
        minibatches_per_rollout or stream.minibatches_per_rollout,
        seed=seed,
        rank=stream.rank,
        world_size=stream.world_size,
        columns=stream.columns,
    )
