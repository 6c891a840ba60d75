"""Early, explicit checks of user settings: each error names the setting, the allowed values and the value.

A :class:`UserError` is a mistake in what the user wrote (a setting, a data file), not a bug: the command line
prints its message as one line and exits non-zero, with no traceback (``GSPO_LIGHTNING_TRACEBACK=1`` shows it).
It is a ``ValueError``, so code that catches those keeps working.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any


class UserError(ValueError):
    """A mistake in the configuration or the data, reported in one line naming what to change."""


class SettingError(UserError):
    """A setting that cannot work, or settings that contradict each other."""


class DataError(UserError):
    """A data file or data set that cannot be trained on; the message names the file, the row and the problem."""


class UserCodeError(RuntimeError):
    """Code the user wrote and named in a setting (a reward function, a tool, an environment) raised ``error``.

    Not a mistake in a setting, nor a bug of the library: the command line prints :meth:`headline` (the setting as
    written, the function and the error), ``detail`` and then only the user's own frames of ``error``'s traceback
    (``GSPO_LIGHTNING_TRACEBACK=1``: the whole traceback; see ``gspo_lightning.cli_errors.user_code_report``).
    ``str()`` is the library's full message, as before.

    Args:
        message: the full message (what was called on what).
        setting: the setting that names the code, e.g. ``sampler.rewards[0]``.
        function: the code's import path, e.g. ``my_rewards.score``.
        error: what it raised.
        context: where, when that helps (``episode 3, turn 1``); in the headline.
        detail: what it was called on (a sample, a tool call); on a line of its own.
    """

    def __init__(
        self, message: str, setting: str, function: str, error: BaseException, context: str = "", detail: str = ""
    ) -> None:
        super().__init__(message)
        self.setting, self.function, self.error, self.context, self.detail = setting, function, error, context, detail

    def headline(self) -> str:
        """``sampler.rewards[0] (my_rewards.score) raised ValueError: bad input``."""
        where = f" ({self.context})" if self.context else ""
        said = str(self.error).strip().splitlines()
        text = f": {said[0]}" if said else ""
        return f"{self.setting} ({self.function}) raised {type(self.error).__name__}{text}{where}"

    def __reduce__(self) -> tuple:  # picklable across processes, whatever the subclass's bases
        names = ("setting", "function", "error", "context", "detail")
        return _rebuilt, (type(self), str(self), {name: getattr(self, name) for name in names})


def _rebuilt(cls: type, message: str, state: dict[str, Any]) -> UserCodeError:
    error = RuntimeError.__new__(cls)
    RuntimeError.__init__(error, message)
    error.__dict__.update(state)
    return error


def user_code_error(error: BaseException | None) -> UserCodeError | None:
    """The ``UserCodeError`` that ``error`` is or was raised from (its ``__cause__`` / ``__context__`` chain: the
    trainer, a background thread or a rank may wrap it), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UserCodeError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def qualified_name(code: Any) -> str:
    """``module.function`` of a function, ``module.Class`` of an instance of a callable class or a class."""
    while isinstance(code, functools.partial):  # what it calls
        code = code.func
    target = code if callable(code) and hasattr(code, "__qualname__") else type(code)
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(code)
    return f"{module}.{name}" if module and module != "builtins" else name


def require(condition: bool, message: str) -> None:
    """Raise ``SettingError(message)`` unless ``condition`` holds."""
    if not condition:
        raise SettingError(message)


def require_one_of(setting: str, value: Any, allowed: Sequence[str], note: str = "") -> None:
    """Raise a ``SettingError`` naming ``setting``, the allowed values and ``value`` unless it is one of them."""
    require(value in allowed, f"{setting} must be one of {list(allowed)}, got {value!r}{note}")


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
