"""Which data columns the reward functions read, checked against the data before any model is built."""

from __future__ import annotations

from collections.abc import Iterable

from gspo_lightning.validation import DataError


def check_reward_columns(rewards: Iterable[object], column_names: Iterable[str], where: str, setting: str) -> None:
    """Each reward's ``required_columns`` (when it declares them) are columns the data has.

    Args:
        rewards: reward functions; those with a ``required_columns`` attribute are checked.
        column_names: the data's columns.
        where: how to name the data, e.g. ``"the training split of 'data.jsonl'"``.
        setting: where the rewards are configured, e.g. ``"sampler.rewards"``.
    """
    available = list(column_names)
    for reward in rewards:
        missing = [name for name in getattr(reward, "required_columns", ()) if name not in available]
        if missing:
            raise DataError(
                f"{setting}: {type(reward).__name__} reads the column(s) {missing}, which {where} does not have; "
                f"available columns: {available} (set the reward's column option, or use another data set)"
            )

