"""Where prompts come from: a data set on disk or on the hub, or the generated arithmetic task.

Every source returns a ``datasets.DatasetDict`` with exactly the splits ``"train"`` (the RL prompt stream) and
``"eval"`` (the held-out prompts scored during training).
"""

from __future__ import annotations

import itertools
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator

import datasets

from gspo_lightning.data.arithmetic import OPERATIONS, arithmetic_problems, is_heldout
from gspo_lightning.data.checks import DataError, MissingDataFile, check_rows, check_text_file
from gspo_lightning.validation import SettingError

# File suffixes read directly with one of the `datasets` packaged builders.
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_TEXT_FILES = (".jsonl", ".json", ".csv")
# Files `save_to_disk` writes: a DatasetDict directory has the first, a Dataset directory the other two.
_SAVED_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")


class PromptSource(ABC):
    """A provider of prompt rows, split into ``"train"`` and ``"eval"``."""

    @abstractmethod
    def load(self) -> datasets.DatasetDict:
        """Return a ``DatasetDict`` with the splits ``"train"`` and ``"eval"``."""

    def describe(self) -> str:
        """How error messages name this source."""
        return type(self).__name__


def _check_eval_size(eval_size: int) -> None:
    if eval_size < 1:
        raise SettingError(f"eval_size must be >= 1 (rows in the held-out split), got {eval_size}")


class GeneratedTask(PromptSource):
    """A task whose problems come from a seeded generator with a fixed held-out side (train/eval never overlap).

    Subclasses implement ``problems(count, heldout)``; this class checks the sizes and builds the splits.
    """

    def __init__(self, train_size: int, eval_size: int, seed: int) -> None:
        if train_size < 1:
            raise SettingError(f"train_size must be >= 1, got {train_size}")
        _check_eval_size(eval_size)
        self.train_size = train_size
        self.eval_size = eval_size
        self.seed = seed

    @abstractmethod
    def problems(self, count: int, heldout: bool) -> Iterator[dict[str, str]]:
        """``count`` rows from the training side (``heldout=False``) or the held-out side of the task."""

    def load(self) -> datasets.DatasetDict:
        def split(count: int, heldout: bool) -> datasets.Dataset:
            return datasets.Dataset.from_list(list(self.problems(count, heldout)))

        return datasets.DatasetDict(
            train=split(self.train_size, heldout=False), eval=split(self.eval_size, heldout=True)
        )


class LoadDataset(PromptSource):
    """A data set from a local file, a ``save_to_disk`` directory, or the Hugging Face hub."""

    def __init__(
        self,
        path: str,
        name: str | None = None,
        split: str = "train",
        eval_split: str | None = None,
        eval_size: int = 256,
        seed: int = 0,
    ) -> None:
        """
        Args:
            path: A local data file (.jsonl, .json, .parquet or .csv), a directory written by
                ``Dataset.save_to_disk``/``DatasetDict.save_to_disk``, or a hub data set name
                (``datasets.load_dataset(path, name)``).
            name: Configuration (subset) name of a hub data set.
            split: Split to draw training prompts from (a local file has the single split "train").
            eval_split: Split to draw held-out prompts from (its first ``eval_size`` rows). When unset,
                ``eval_size`` rows are held out of ``split`` at random (deterministic given ``seed``).
            eval_size: Number of held-out prompts.
            seed: Seed of the random held-out selection when ``eval_split`` is unset.
        """
        _check_eval_size(eval_size)
        if eval_split is not None and eval_split == split:
            raise SettingError(
                f"eval_split ({eval_split!r}) must differ from split ({split!r}): held-out prompts must not be "
                "trained on; leave eval_split unset to hold out rows of the training split"
            )
        self.path = path
        self.name = name
        self.split = split
        self.eval_split = eval_split
        self.eval_size = eval_size
        self.seed = seed

    def describe(self) -> str:
        return repr(self.path)

    def load(self) -> datasets.DatasetDict:
        splits = self._read()
        # Rows as stored (before any held-out carving shuffles them), so an error's row number is the file's.
        for name, split in splits.items() if isinstance(splits, datasets.DatasetDict) else [("train", splits)]:
            check_rows(split, f"{self.path!r} (split {name!r})")
        train = self._pick(splits, self.split, "split")
        if self.eval_split is not None:
            evaluation = self._pick(splits, self.eval_split, "eval_split")
            evaluation = evaluation.select(range(min(self.eval_size, len(evaluation))))
            return datasets.DatasetDict(train=train, eval=evaluation)
        if self.eval_size >= len(train):
            raise SettingError(
                f"eval_size ({self.eval_size}) must be smaller than the {len(train)} rows of split "
                f"{self.split!r} it is held out of; lower eval_size or set eval_split"
            )
        carved = train.train_test_split(test_size=self.eval_size, shuffle=True, seed=self.seed)
        return datasets.DatasetDict(train=carved["train"], eval=carved["test"])

    def _read(self) -> datasets.DatasetDict | datasets.Dataset:
        """Read ``path`` as a data file, a saved data set, or (otherwise) a hub name / data directory."""
        suffix = os.path.splitext(self.path)[1].lower()
        if os.path.isfile(self.path):
            if suffix not in _FILE_BUILDERS:
                raise SettingError(
                    f"path {self.path!r} is a file of unsupported type {suffix!r}; "
                    f"supported: {sorted(_FILE_BUILDERS)}"
                )
            if suffix in _TEXT_FILES:
                check_text_file(self.path)  # line-numbered errors before the reader sees the file
            return datasets.load_dataset(_FILE_BUILDERS[suffix], data_files=self.path)
        if os.path.isdir(self.path) and any(
            os.path.exists(os.path.join(self.path, marker)) for marker in _SAVED_MARKERS
        ):
            return datasets.load_from_disk(self.path)
        if suffix in _FILE_BUILDERS:  # meant as a local file: do not send a typo to the hub
            raise MissingDataFile(f"data file {self.path!r} does not exist (data.init_args.source.init_args.path)")
        # A hub name, or a local directory of data files that `load_dataset` can infer.
        try:
            return datasets.load_dataset(self.path, self.name)
        except (OSError, ValueError) as error:  # offline, a typo, no access, an unknown config name
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise DataError(
                f"data set {self.path!r} (data.init_args.source.init_args.path) is neither a local file nor a saved "
                f"data set, and loading it by name failed: {first}"
            ) from error

    def _pick(
        self, splits: datasets.DatasetDict | datasets.Dataset, wanted: str, setting: str
    ) -> datasets.Dataset:
        if isinstance(splits, datasets.Dataset):
            # A single saved Dataset has no split names: it is the training data, and nothing else.
            if setting == "eval_split":
                raise SettingError(
                    f"path {self.path!r} holds a single Dataset without splits, so eval_split={wanted!r} "
                    "cannot be found; leave eval_split unset to hold out rows of it"
                )
            return splits
        if wanted not in splits:
            raise SettingError(
                f"{setting}={wanted!r} not found in {self.path!r}; available splits: {sorted(splits)}"
            )
        return splits[wanted]


class ArithmeticTask(GeneratedTask):
    """Generated multi-digit arithmetic problems with exact answers (the quick-start task)."""

    def __init__(
        self,
        num_digits: int = 3,
        operations: str = "+",
        train_size: int = 20000,
        eval_size: int = 256,
        seed: int = 0,
    ) -> None:
        """
        Args:
            num_digits: Digits of each operand (3 gives problems like ``123+456``).
            operations: Operators to draw from, any of ``+``, ``-``, ``*`` (e.g. ``"+-"``).
            train_size: Number of training problems.
            eval_size: Number of held-out problems; drawn from a fixed 1/32 of all questions that training
                never sees, whatever the seed.
            seed: Seed of the problem generator.
        """
        super().__init__(train_size, eval_size, seed)
        # Draw one problem so that bad num_digits/operations fail here, not at load time.
        next(arithmetic_problems(1, num_digits=num_digits, operations=operations, seed=seed))
        _check_heldout_side_exists(num_digits, operations)
        self.num_digits = num_digits
        self.operations = operations

    def problems(self, count: int, heldout: bool) -> Iterator[dict[str, str]]:
        return arithmetic_problems(count, self.num_digits, self.operations, seed=self.seed, heldout=heldout)


def _check_heldout_side_exists(num_digits: int, operations: str) -> None:
    """Fail early where the problem space is so small that one side of the split is empty.

    The generator rejection-samples questions of one side; with no such question it would loop forever.
    Only spaces with 1- or 2-digit operands are small enough for that (and cheap to enumerate).
    """
    if num_digits > 2:
        return
    operands = range(10 ** (num_digits - 1), 10**num_digits)
    questions = [f"{a}{op}{b}" for a, b in itertools.product(operands, operands) for op in set(operations)]
    heldout = sum(map(is_heldout, questions))
    if heldout == 0 or heldout == len(questions):
        raise SettingError(
            f"num_digits={num_digits} with operations={operations!r} gives {len(questions)} questions, "
            f"{heldout} of them held out: too few to split into train and eval; use more digits or operations "
            f"(from {sorted(OPERATIONS)})"
        )
