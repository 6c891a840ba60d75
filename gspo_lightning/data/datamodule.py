"""The Lightning data module: the training prompt stream and the held-out prompts, per rank.

Exact resume under Lightning. For a data loader without a length, Lightning's fit loop fetches one batch
ahead of the one being trained on (``_PrefetchDataFetcher``, to detect the last batch). When a checkpoint is
saved, the loader has therefore already produced the *next* batch, and a ``StatefulDataLoader`` state taken
then (``_num_yielded`` / the data set's live state) points one batch too far: the resumed run would skip it.
``PromptLoader`` instead saves the position after the last batch actually handed to ``training_step``:
``PromptDataModule.on_before_batch_transfer``, which Lightning calls only for that batch, reports it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import datasets
from lightning.pytorch import LightningDataModule
from torchdata.stateful_dataloader import StatefulDataLoader

from gspo_lightning.data.checks import check_rows
from gspo_lightning.data.formatting import PromptFormatter
from gspo_lightning.data.sources import PromptSource
from gspo_lightning.data.stream import PromptStream, make_prompt_batch, replace_seed
from gspo_lightning.rollout.types import Prompt, PromptBatch
from gspo_lightning.validation import SettingError

SPLITS = ("train", "eval")


def identity(batch: PromptBatch) -> PromptBatch:
    """Collate function: the stream already yields whole ``PromptBatch`` items (module-level to pickle)."""
    return batch


class PromptLoader(StatefulDataLoader):
    """A ``StatefulDataLoader`` over a ``PromptStream`` whose state is the position after the last batch used.

    A batch counts as used when the loader yields it (``advance_on="yield"``, right for a plain loop), or only
    when ``mark_used`` is called with it (``advance_on="use"``, for consumers that fetch ahead, like Lightning).
    Every ``iter()`` restarts from that position, so batches fetched ahead but never used are served again.
    The state is that position alone (not torchdata's per-worker snapshots), so it does not depend on
    ``num_workers``; workers are not kept between iterators (no ``persistent_workers``), since each new
    iterator must hand its workers the restored position.
    """

    def __init__(
        self, stream: PromptStream, num_workers: int = 0, advance_on: Literal["yield", "use"] = "yield"
    ) -> None:
        """
        Args:
            stream: the prompt stream to serve.
            num_workers: worker processes (0 = in the main process).
            advance_on: ``"yield"`` or ``"use"``: what moves the saved position (see the class docstring).
        """
        if advance_on not in ("yield", "use"):
            raise ValueError(f"advance_on must be 'yield' or 'use', got {advance_on!r}")
        super().__init__(stream, batch_size=None, collate_fn=identity, num_workers=num_workers)
        self.advance_on = advance_on
        self._resume_state = stream.state_dict()

    def __iter__(self) -> Iterator[PromptBatch]:  # type: ignore[override]
        # Set the position before the iterator exists: workers receive a copy of the stream when it is built.
        self.dataset.load_state_dict(self._resume_state)
        return self._track(super().__iter__())

    def _track(self, batches: Iterator[PromptBatch]) -> Iterator[PromptBatch]:
        for batch in batches:
            if self.advance_on == "yield":
                self.mark_used(batch)
            yield batch

    def mark_used(self, batch: PromptBatch) -> None:
        """Record that ``batch`` was consumed: a saved state resumes with the item after it."""
        self._resume_state = self.dataset.state_after(batch)

    def state_dict(self) -> dict[str, Any]:
        """``{"stream": PromptStream state}`` of the next batch to serve."""
        return {"stream": dict(self._resume_state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Serve from a saved position on the next ``iter()``."""
        if "stream" not in state_dict:
            raise ValueError(f"not a {type(self).__name__} state (no 'stream' key): {sorted(state_dict)}")
        self.dataset.load_state_dict(state_dict["stream"])  # validates the layout first
        self._resume_state = self.dataset.state_dict()
        super().load_state_dict({})  # drops any live iterator: the next iter() starts at the restored position


class PromptDataModule(LightningDataModule):
    """Prompts for GSPO: an endless per-rank stream of rollout batches and the held-out prompts."""

    def __init__(
        self,
        source: PromptSource,
        prompt_template: str = "{question}",
        chat_template: bool = False,
        system_prompt: str | None = None,
        prompts_per_rollout: int = 16,
        minibatches_per_rollout: int = 4,
        eval_batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        """
        Args:
            source: Where prompts come from, e.g. ``LoadDataset`` or ``ArithmeticTask``.
            prompt_template: Python format string over the data set's columns giving the prompt text,
                e.g. ``"Compute {question}. Answer:"``. Every column is passed to the rewards.
            chat_template: Make each prompt a chat conversation (rendered by the tokenizer's chat template)
                instead of a plain string.
            system_prompt: System message put before each chat prompt; requires ``chat_template: true``.
            prompts_per_rollout: Prompts per rollout batch on each rank (P); each is sampled G times.
            minibatches_per_rollout: Optimizer steps taken on each rollout batch (K); the batch is served K
                times in a row, once per step.
            eval_batch_size: Held-out prompts per evaluation batch on each rank.
            seed: Seed of the per-epoch shuffling of the training prompts (the same on all ranks).
            num_workers: Data loader worker processes for the training stream (0 = in the main process).
        """
        super().__init__()
        if not isinstance(source, PromptSource):
            raise TypeError(f"source must be a PromptSource (e.g. LoadDataset, ArithmeticTask), got {source!r}")
        positive = {
            "prompts_per_rollout": prompts_per_rollout,
            "minibatches_per_rollout": minibatches_per_rollout,
            "eval_batch_size": eval_batch_size,
        }
        for setting, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise SettingError(f"data.{setting} must be a positive integer, got {value!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise SettingError(f"data.num_workers must be an integer >= 0, got {num_workers!r}")
        self.source = source
        self.formatter = PromptFormatter(prompt_template, chat=chat_template, system_prompt=system_prompt)
        self.prompts_per_rollout = prompts_per_rollout
        self.minibatches_per_rollout = minibatches_per_rollout
        self.eval_batch_size = eval_batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.rank, self.world_size = 0, 1
        self._splits: datasets.DatasetDict | None = None
        self._train_loader: PromptLoader | None = None
        self._refill: PromptStream | None = None
        self._refill_state: dict[str, Any] | None = None
        self._rollout_stream: PromptStream | None = None

    def setup(self, stage: str | None = None) -> None:
        """Load the source (once) and check it against the template and this rank's share."""
        if self.trainer is not None:
            self.rank, self.world_size = self.trainer.global_rank, self.trainer.world_size
        if self._splits is None:
            self._splits = self._load_splits()
        if len(self._split("eval")) < self.world_size:
            raise SettingError(
                f"the eval split has {len(self._split('eval'))} rows, fewer than the {self.world_size} ranks; "
                "raise the source's eval_size"
            )
        self._train_stream()  # fails now, not at the first step, if a rank's share is too small

    def _load_splits(self) -> datasets.DatasetDict:
        splits = self.source.load()
        missing = [name for name in SPLITS if name not in splits]
        if missing:
            raise SettingError(
                f"{type(self.source).__name__}.load() returned the splits {sorted(splits)}, lacking {missing}"
            )
        for name in SPLITS:
            where = self.describe_split(name)
            check_rows(splits[name], where)
            self.formatter.check_columns(splits[name].column_names, where=where)
        return splits

    def column_names(self, split: str = "train") -> list[str]:
        """The columns of ``split`` (``train`` or ``eval``), which rewards receive; after ``setup``."""
        return list(self._split(split).column_names)

    def describe_split(self, split: str = "train") -> str:
        """How error messages name ``split``, e.g. "the 'train' split of 'data.jsonl'"."""
        return f"the {split!r} split of {self.source.describe()}"

    def _split(self, name: str) -> datasets.Dataset:
        if self._splits is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before its data is used")
        return self._splits[name]

    def _train_stream(self) -> PromptStream:
        train = self._split("train")
        return PromptStream(
            train,
            self.formatter,
            prompts_per_rollout=self.prompts_per_rollout,
            minibatches_per_rollout=self.minibatches_per_rollout,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            columns=list(train.column_names),
        )

    def rollout_batch(self, rollout_index: int) -> PromptBatch:
        """The prompts of this rank's rollout round ``rollout_index``, as the training loader serves them: the
        stream is a function of the index, so asynchronous rollouts can sample a round before it is served."""
        stream = self._rollout_stream
        if stream is None:
            stream = self._rollout_stream = self._train_stream()
        rows = self._split("train")[stream.rollout_indices(rollout_index)]
        return make_prompt_batch(rows, self.formatter, stream.columns, rollout_index, 0, self.minibatches_per_rollout)

    def draw_prompts(self) -> PromptBatch:
        """One more batch of P training prompts on this rank, for the sampler's dynamic sampling.

        They come from a second stream over the training split with its own shuffle (``seed`` + 1), so the main
        stream's position, and with it exact resume, is untouched; this stream's position is saved with the data
        module's state. The held-out split is never drawn.
        """
        if self._refill is None:
            self._refill = replace_seed(self._train_stream(), self.seed + 1, minibatches_per_rollout=1)
            if self._refill_state is not None:
                self._refill.load_state_dict(self._refill_state)
        return next(iter(self._refill))

    def state_dict(self) -> dict[str, Any]:
        """The dynamic-sampling stream's position (the main stream's travels with its data loader)."""
        return {"refill": self._refill.state_dict()} if self._refill is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._refill_state = state_dict.get("refill")
        self._refill = None  # rebuilt at the next draw, from the saved position

    def train_dataloader(self) -> PromptLoader:
        """The endless training stream; stop training with ``max_steps``."""
        self._train_loader = PromptLoader(self._train_stream(), num_workers=self.num_workers, advance_on="use")
        return self._train_loader

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Lightning calls this only for the batch about to reach training_step (not for the one it fetched
        # ahead), so it is where the loader learns which batch a checkpoint must resume after.
        training = self.trainer is not None and self.trainer.training
        if training and isinstance(batch, PromptBatch) and self._train_loader is not None:
            self._train_loader.mark_used(batch)
        return batch

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        if not isinstance(batch, PromptBatch):
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        # Prompts and columns are Python values, tokenized on the module's device by the sampler, which also
        # moves the minibatch it attaches (after this): walking them with Lightning's mover costs for nothing.
        return batch

    def prompt_chunks(self, split: str = "train", size: int = 1024) -> Iterator[tuple[int, list[Prompt]]]:
        """Every prompt of ``split`` (all ranks' rows, in order), ``size`` at a time: (first row's index, prompts).
        The sampler checks each one's length against the context at fit start, not when the row is drawn."""
        rows = self._split(split)
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]
            records = [dict(zip(chunk, values)) for values in zip(*chunk.values())]
            yield start, [self.formatter(record) for record in records]

    @property
    def heldout_size(self) -> int:
        """Held-out prompts on this rank (rows ``rank::world_size`` of the eval split)."""
        return len(range(self.rank, len(self._split("eval")), self.world_size))

    def heldout_dataloader(self) -> Iterator[PromptBatch]:
        """This rank's held-out prompts, in order, in batches of ``eval_batch_size`` (a fresh iterator).

        Ranks may get one row (and so one batch) more than others when the eval split is not a multiple of
        ``world_size`` (times ``eval_batch_size``).
        """
        evaluation = self._split("eval")
        indices = list(range(self.rank, len(evaluation), self.world_size))
        columns = list(evaluation.column_names)
        return self._heldout_batches(evaluation, indices, columns)

    def _heldout_batches(
        self, evaluation: datasets.Dataset, indices: list[int], columns: list[str]
    ) -> Iterator[PromptBatch]:
        for number, start in enumerate(range(0, len(indices), self.eval_batch_size)):
            rows = evaluation[indices[start : start + self.eval_batch_size]]
            yield make_prompt_batch(rows, self.formatter, columns, rollout_index=number)
