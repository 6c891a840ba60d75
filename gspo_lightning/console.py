"""What the command line shows while it runs: progress, real warnings, no library noise.

The command line (not the library: a user's own script keeps control of its warnings) silences what is not about
the user's run: deprecation notices libraries raise against each other, Lightning's advertisement, the weight
loader's progress bar for a tiny cached model. Rich's progress bar counts optimizer steps instead of the
meaningless "Epoch 0/-2" of an endless prompt stream.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBar

_LIBRARY_NOTICES = (
    r"'set_vital' is deprecated",  # torchdata's StatefulDataLoader calling torch
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning calling torch's pytree
    r"`torch.distributed.reduce_op` is deprecated",  # vLLM calling torch
)
_ADVERTISEMENTS = ("💡 Tip:",)


class _DropAdvertisements(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(_ADVERTISEMENTS)


def quiet_library_noise() -> None:
    """Silence the notices above for this process (the command line calls it once)."""
    for message in _LIBRARY_NOTICES:
        warnings.filterwarnings("ignore", message=message)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropAdvertisements) for existing in logger.filters):
            logger.addFilter(_DropAdvertisements())
    try:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # "Loading weights" for every from_pretrained
    except ImportError:
        pass


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, labelled by what it counts: optimizer steps out of ``max_steps``. The prompt
    stream is endless, so Lightning's "Epoch 0/-2" (``max_epochs=-1``) says nothing; nor does the logger's version
    number shown as a metric ("v_num: 0.000")."""

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description="optimizer steps")
