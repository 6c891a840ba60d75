"""What ``GroupSampler`` and ``HeldOutEvaluation`` read from the trainer's LightningDataModule: ``SamplerData``.

Training itself needs only a dataloader of ``PromptBatch`` items (``docs/reuse.md``), so a run may have no data
module at all. Each member of ``SamplerData`` serves the settings named beside it: a data module that lacks one
is refused, naming the member and the setting, when that setting is used; the fit-start checks a missing member
would have run are skipped. ``PromptDataModule`` has every member. ``DataSide`` is the one place that reads
them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from gspo_lightning.rollout.types import Prompt, PromptBatch
from gspo_lightning.validation import SettingError


class PromptFormat(Protocol):
    """How a data module turns rows into prompts: ``chat`` prompts go through the tokenizer's chat template."""

    chat: bool
    template: str


class SamplerData(Protocol):
    """The data module's side of a run, beyond its ``train_dataloader``.

    Attributes:
        prompts_per_rollout: P, prompts per round and rank: ``sampler.num_minibatches`` must divide P x G
            (checked before the policy is built).
        eval_batch_size: held-out prompts per evaluation batch (optional: an engine sizes its memory by it).
        formatter: the prompts' format: chat prompts need a tokenizer with a chat template.
        source: the task the prompts come from (a warm-start policy checks it was trained on the same task).
    """

    prompts_per_rollout: int
    eval_batch_size: int
    formatter: PromptFormat
    source: Any

    def column_names(self, split: str = "train") -> list[str]:
        """The split's columns, for the rewards' (and ``evaluation.correct``'s) ``required_columns``."""
        ...

    def describe_split(self, split: str = "train") -> str:
        """The split as an error message should name it (its file, data set or task)."""
        ...

    def prompt_chunks(self, split: str = "train", size: int = 1024) -> Iterator[tuple[int, list[Prompt]]]:
        """Every prompt of the split, formatted, in chunks with their first row: the fit-start checks of prompt
        lengths (``sampler.prompt_overflow: error``) and of ``model.micro_batch_tokens``."""
        ...

    def rollout_batch(self, rollout_index: int) -> PromptBatch:
        """Any round's prompts by index: ``sampler.asynchronous`` samples rounds ahead of the dataloader."""
        ...

    def draw_prompts(self) -> PromptBatch:
        """More prompts from the stream: ``sampler.dynamic_sampling``'s refills."""
        ...

    def heldout_dataloader(self) -> Iterable[PromptBatch]:
        """The held-out prompts, for ``HeldOutEvaluation``."""
        ...


class DataSide:
    """The trainer's data module (or None), read through ``SamplerData``'s members: ``offers`` says whether it
    has one, ``needs`` returns it or raises a ``SettingError`` naming the member and the setting that uses it."""

    def __init__(self, datamodule: Any) -> None:
        self.datamodule = datamodule

    def offers(self, member: str) -> bool:
        if self.datamodule is None or member not in MEMBERS:
            return False
        value = getattr(self.datamodule, member, None)
        return value is not None and (callable(value) or member not in METHODS)

    def needs(self, member: str, setting: str) -> Any:
        """The member, for ``setting`` (as a user writes it); refused when the data module lacks it."""
        if not self.offers(member):
            which = "no data module" if self.datamodule is None else f"the data module {type(self.datamodule).__name__}"
            raise SettingError(
                f"{setting} needs the data module's {MEMBERS[member]} ({which} has none): use "
                "gspo_lightning.data.PromptDataModule, or give yours what "
                "gspo_lightning.rollout.data_contract.SamplerData declares (docs/reuse.md)"
            )
        return getattr(self.datamodule, member)

    def prompts_per_rollout(self) -> int | None:
        return self.datamodule.prompts_per_rollout if self.offers("prompts_per_rollout") else None

    def eval_batch_size(self) -> int | None:
        return self.datamodule.eval_batch_size if self.offers("eval_batch_size") else None

    def chat(self) -> bool:
        return self.offers("formatter") and bool(getattr(self.datamodule.formatter, "chat", False))

    def template(self) -> str | None:
        return getattr(self.datamodule.formatter, "template", None) if self.offers("formatter") else None

    def describe_split(self, split: str) -> str:
        return self.datamodule.describe_split(split) if self.offers("describe_split") else f"the {split!r} split"


METHODS = ("column_names", "describe_split", "prompt_chunks", "rollout_batch", "draw_prompts", "heldout_dataloader")
MEMBERS: dict[str, str] = {
    "prompts_per_rollout": "prompts_per_rollout (prompts per round)",
    "eval_batch_size": "eval_batch_size (held-out prompts per batch)",
    "formatter": "formatter (its prompts' format)",
    "source": "source (its task)",
    "column_names": "column_names(split)",
    "describe_split": "describe_split(split)",
    "prompt_chunks": "prompt_chunks(split)",
    "rollout_batch": "rollout_batch(index) (any round's prompts by index)",
    "draw_prompts": "draw_prompts() (more prompts from the stream)",
    "heldout_dataloader": "heldout_dataloader() (the held-out prompts)",
}
"""``SamplerData``'s members, as an error names them."""
