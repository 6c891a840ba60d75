"""Prompt data: sources, formatting, the resumable per-rank prompt stream and the Lightning data module."""

from gspo_lightning.data.countdown import CountdownTask
from gspo_lightning.data.datamodule import PromptDataModule
from gspo_lightning.data.formatting import PromptFormatter
from gspo_lightning.data.sample_data import SampleDataset
from gspo_lightning.data.scratchpad import ScratchpadAdditionTask
from gspo_lightning.data.sources import ArithmeticTask, LoadDataset, PromptSource

__all__ = [
    "ArithmeticTask",
    "CountdownTask",
    "LoadDataset",
    "PromptDataModule",
    "PromptFormatter",
    "PromptSource",
    "SampleDataset",
    "ScratchpadAdditionTask",
]
