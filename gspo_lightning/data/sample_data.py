"""Tiny data samples shipped with the package, so every task runs in tests and demos without network.

Each ``gspo_lightning/data/samples/<name>.jsonl`` holds a few dozen original rows in the column layout of a
public data set (``gsm8k``: ``question``/``answer`` as in openai/gsm8k; ``competition_math``:
``problem``/``solution``/``level``/``type`` as in competition MATH), so a config written for the real data set
runs on its sample by swapping the source alone.
"""

from __future__ import annotations

from pathlib import Path

import datasets

from gspo_lightning.data.sources import LoadDataset, PromptSource

SAMPLES_DIR = Path(__file__).with_name("samples")
"""Where the sample files live (shipped as package data, see pyproject.toml)."""


def available_samples() -> list[str]:
    """The names ``SampleDataset`` accepts: every ``*.jsonl`` in :data:`SAMPLES_DIR`, sorted."""
    return sorted(path.stem for path in SAMPLES_DIR.glob("*.jsonl"))


def sample_path(name: str) -> Path:
    """The file of sample ``name``; raises ``ValueError`` listing the available names if there is none."""
    available = available_samples()
    if name not in available:  # also rejects "../x", "gsm8k.jsonl" and other path-like names
        raise ValueError(f"unknown sample {name!r}; available samples: {available}")
    return SAMPLES_DIR / f"{name}.jsonl"


class SampleDataset(PromptSource):
    """A tiny data sample shipped with the package (no network), read like ``LoadDataset`` reads a local file."""

    def __init__(self, name: str, eval_size: int = 8, seed: int = 0) -> None:
        """
        Args:
            name: The sample, the stem of a file in ``gspo_lightning/data/samples`` (e.g. ``gsm8k``,
                ``competition_math``); an unknown name lists the available ones.
            eval_size: Rows held out of the sample for evaluation (at random, deterministic given ``seed``);
                fewer than the sample's rows.
            seed: Seed of the held-out selection.
        """
        self.name = name
        self.eval_size = eval_size
        self.seed = seed
        self.path = sample_path(name)
        # Built now, so that a bad eval_size fails at configuration time as with LoadDataset.
        self._source = LoadDataset(str(self.path), eval_size=eval_size, seed=seed)

    def load(self) -> datasets.DatasetDict:
        return self._source.load()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, eval_size={self.eval_size}, seed={self.seed})"
