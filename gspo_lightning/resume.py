"""Resuming with changed settings: refuse what the saved round depends on, apply what may change.

LightningCLI would merge a checkpoint's hyper-parameters over the command line (``GSPOCLI`` keeps the command
line's), and Lightning restores the optimizer and scheduler with the checkpoint's learning rate and weight decay.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

RESUME_FIXED = {"policy": "model.policy", "objective": "model.objective", "temperature": "sampler.temperature"}
"""Module settings a resumed run cannot change (the saved round's pi_old and advantages depend on them), by the
name a user sets them under (the temperature is the sampler's, linked to the module's)."""


def check_fixed_settings(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise naming every ``RESUME_FIXED`` setting that differs between the checkpoint's and the current ones."""
    changed = [
        f"{label} (checkpoint {saved[key]!r}, now {current[key]!r})"
        for key, label in RESUME_FIXED.items()
        if key in saved and comparable(saved[key]) != comparable(current[key])
    ]
    if changed:
        raise ValueError(f"cannot resume with a changed {'; '.join(changed)}: start a new run to change it")


def comparable(value: Any) -> Any:
    """A comparable form of a setting: plain values as they are, objects (a policy loader, a spec) by their type
    and public attributes, so that equal settings compare equal across processes."""
    if isinstance(value, dict):
        return {key: comparable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [comparable(item) for item in value]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        public = {key: comparable(item) for key, item in vars(value).items() if not key.startswith("_")}
        return (type(value).__qualname__, public)
    return value


def rebase_optimizers(trainer: pl.Trainer, saved_lr: float, lr: float, saved_decay: float, decay: float) -> None:
    """The restored optimizers and schedulers at the configured learning rate and weight decay, the schedule's
    position (its factor at this step) kept: each lr times ``lr / saved_lr``."""
    ratio = lr / saved_lr
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            group["lr"] *= ratio
            if "initial_lr" in group:
                group["initial_lr"] *= ratio
            if saved_decay != decay:
                group["weight_decay"] = decay
    for config in trainer.lr_scheduler_configs:
        config.scheduler.base_lrs = [base * ratio for base in config.scheduler.base_lrs]
