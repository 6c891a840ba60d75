"""Prompt data: sources and tasks (with their warm-started tiny policies), formatting, the resumable per-rank
prompt stream and the Lightning data module."""

from gspo_lightning.data.arithmetic_warm_start import WarmStartedTinyQwen3
from gspo_lightning.data.calculator_warm_start import CalculatorWarmStartedTinyQwen3
from gspo_lightning.data.countdown import CountdownTask
from gspo_lightning.data.countdown_warm_start import CountdownWarmStartedTinyQwen3
from gspo_lightning.data.datamodule import PromptDataModule
from gspo_lightning.data.formatting import PromptFormatter
from gspo_lightning.data.sample_data import SampleDataset
from gspo_lightning.data.scratchpad import ScratchpadAdditionTask
from gspo_lightning.data.scratchpad_warm_start import ScratchpadWarmStartedTinyQwen3
from gspo_lightning.data.sources import ArithmeticTask, LoadDataset, PromptSource

__all__ = [
    "ArithmeticTask",
    "CalculatorWarmStartedTinyQwen3",
    "CountdownTask",
    "CountdownWarmStartedTinyQwen3",
    "LoadDataset",
    "PromptDataModule",
    "PromptFormatter",
    "PromptSource",
    "SampleDataset",
    "ScratchpadAdditionTask",
    "ScratchpadWarmStartedTinyQwen3",
    "WarmStartedTinyQwen3",
]
