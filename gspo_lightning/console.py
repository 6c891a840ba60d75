"""What the command line shows while it runs: real warnings, plainly, and no library noise.

The one place that sets the console's process-wide state, called once by the command line
(:func:`configure_console`; not by the library: a user's own script keeps control of its warnings). It silences
what is not about the user's run (deprecation notices libraries raise against each other, Lightning's
advertisement, the weight loader's progress bar for a tiny cached model) and prints the project's own warnings as
``warning: <message>``, without the source file and line that only a developer wants. The progress bars live in
:mod:`gspo_lightning.progress`.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

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


_PACKAGE = str(Path(__file__).resolve().parent) + os.sep
_library_format = warnings.formatwarning


def _format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, line=None) -> str:
    if str(Path(filename).resolve()).startswith(_PACKAGE):  # the project's own: the message is all the news
        return f"warning: {message}\n"
    return _library_format(message, category, filename, lineno, line)


def plain_project_warnings() -> None:
    """Print the warnings raised from this package as ``warning: <message>`` (others keep Python's format)."""
    warnings.formatwarning = _format_warning


def configure_console() -> None:
    """Everything above, for this process: the command line calls it once at startup."""
    quiet_library_noise()
    plain_project_warnings()
