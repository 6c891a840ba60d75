"""Resuming with changed settings: refuse what the saved round depends on, apply what may change.

LightningCLI would merge a checkpoint's hyper-parameters over the command line (``GSPOCLI`` keeps the command
line's), and Lightning restores the optimizers and schedulers with the checkpoint's settings (learning rate, betas,
weight decay, ...): the configured ones are put back.
"""

from __future__ import annotations

from gspo_lightning.validation import SettingError
from typing import Any

import lightning.pytorch as pl
import torch

RESUME_FIXED = {"policy": "model.policy", "objective": "model.objective", "temperature": "model.temperature"}
"""Module settings a resumed run cannot change (the saved round's pi_old and advantages depend on them), by the
name a user sets them under."""


def check_fixed_settings(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise naming every ``RESUME_FIXED`` setting that differs between the checkpoint's and the current ones."""
    changed = [
        f"{label} (checkpoint {saved[key]!r}, now {current[key]!r})"
        for key, label in RESUME_FIXED.items()
        if key in saved and comparable(saved[key]) != comparable(current[key])
    ]
    if changed:
        raise SettingError(f"cannot resume with a changed {'; '.join(changed)}: start a new run to change it")


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


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (learning rate, betas, weight decay, ...), without its parameters."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def apply_configured_settings(trainer: pl.Trainer, configured: list[list[dict[str, Any]]]) -> None:
    """The restored optimizers at the configured settings (``configured``: :func:`optimizer_settings` of each
    optimizer as built, before the checkpoint replaced them), the schedule's position kept: a changed base learning
    rate scales every learning rate of its group, and the scheduler's ``base_lrs`` follow. A fresh run is left as
    it is (its settings are the configured ones)."""
    for optimizer, groups in zip(trainer.optimizers, configured, strict=False):
        for group, fresh in zip(optimizer.param_groups, groups, strict=False):
            base, new_base = group.get("initial_lr", group["lr"]), fresh.get("initial_lr", fresh["lr"])
            if base != new_base:
                group["lr"] *= new_base / base
                if "initial_lr" in group:
                    group["initial_lr"] = new_base
            for key, value in fresh.items():
                if key not in ("lr", "initial_lr") and key in group and group[key] != value:
                    group[key] = value
    for config in trainer.lr_scheduler_configs:
        groups = config.scheduler.optimizer.param_groups
        config.scheduler.base_lrs = [group.get("initial_lr", group["lr"]) for group in groups]
