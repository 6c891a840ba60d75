"""Early, explicit checks of user settings: each error names the setting, the allowed values and the value.

A :class:`UserError` is a mistake in what the user wrote (a setting, a data file), not a bug: the command line
prints its message as one line and exits non-zero, with no traceback (``GSPO_LIGHTNING_TRACEBACK=1`` shows it).
It is a ``ValueError``, so code that catches those keeps working.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class UserError(ValueError):
    """A mistake in the configuration or the data, reported in one line naming what to change."""


class SettingError(UserError):
    """A setting that cannot work, or settings that contradict each other."""


class DataError(UserError):
    """A data file or data set that cannot be trained on; the message names the file, the row and the problem."""


def require(condition: bool, message: str) -> None:
    """Raise ``SettingError(message)`` unless ``condition`` holds."""
    if not condition:
        raise SettingError(message)


_OPTIMIZER_SETTINGS = {"learning rate": "lr", "beta": "betas", "epsilon": "eps", "weight_decay": "weight_decay",
                       "momentum": "momentum", "dampening": "dampening"}  # fmt: skip
"""torch's error wording -> the optimizer argument it is about."""


def check_optimizer_settings(optimizer: Callable[..., Any], lr_scheduler: Callable[..., Any] | None) -> None:
    """Build the configured optimizer, and its schedule, over one probe parameter: torch checks an optimizer's
    settings (a negative learning rate, betas outside [0, 1)) only when it is built, which is otherwise after the
    policy has loaded (and a warm start trained), and names no setting."""
    import torch

    try:
        built = optimizer([torch.nn.Parameter(torch.zeros(1))])
    except (ValueError, TypeError) as error:
        name = next((arg for words, arg in _OPTIMIZER_SETTINGS.items() if words in str(error).lower()), None)
        setting = f"optimizer.init_args.{name}" if name else "optimizer"
        raise SettingError(f"{setting}: {error} (refused by the optimizer when built)") from error
    lr = built.defaults.get("lr")
    require(not isinstance(lr, int | float) or lr > 0, f"optimizer.init_args.lr must be > 0, got {lr}")
    if lr_scheduler is not None:
        try:
            lr_scheduler(built)
        except SettingError:
            raise
        except (ValueError, TypeError) as error:
            raise SettingError(f"lr_scheduler: {error} (refused by the schedule when built)") from error
