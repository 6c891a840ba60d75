"""What the console shows while a run trains: rich's bar on a terminal, a plain line every so often elsewhere.

Both count optimizer steps out of ``trainer.max_steps`` (``trainer.global_step``, so a resumed run shows
``201/2000``, not ``1/1799``), and both read one :class:`RunRecord`: where this process started, how fast it goes,
how stale its samples are. The command line (``gspo_lightning.cli``) picks the bar when stdout is a terminal and
:class:`PlainProgress` otherwise (a batch job, ``nohup``, CI), where a bar cannot draw and would print nothing.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBar

from gspo_lightning.sampling import HeldOutEvaluation

REWARD = "rollout/reward_mean"
LAG_MEAN, LAG_MAX = "rollout/lag_tokens_mean", "rollout/lag_tokens_max"
"""The sampler's metrics the console shows (``docs/logging.md``): reward, and under ``sampler.asynchronous`` how
many versions old the trained tokens were."""


@dataclass(frozen=True)
class Progress:
    """Where a run stands, as the console prints it."""

    step: int
    max_steps: int  # <= 0: no limit
    steps_done: int  # by this process (a resumed run counts from where it resumed)
    seconds: float  # since this process's first step started
    reward: float | None = None  # the latest round's mean reward
    accuracy: tuple[int, float] | None = None  # (step, held-out accuracy) of the latest evaluation
    lag: float | None = None  # the latest round's mean token lag (sampler.asynchronous)
    lag_max: float | None = None  # the largest token lag trained so far by this process

    @property
    def steps_per_s(self) -> float | None:
        return self.steps_done / self.seconds if self.steps_done and self.seconds > 0 else None

    @property
    def seconds_left(self) -> float | None:
        rate = self.steps_per_s
        return (self.max_steps - self.step) / rate if rate and self.max_steps > 0 else None


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def progress_line(progress: Progress) -> str:
    """``step 250/2000  reward 0.41  held-out 38.3% (step 250)  lag 1.00 (max 1)  2.1 steps/s  3m05s, 14m00s left``."""
    parts = [f"step {progress.step}/{progress.max_steps}" if progress.max_steps > 0 else f"step {progress.step}"]
    if progress.reward is not None:
        parts.append(f"reward {progress.reward:.3f}")
    if progress.accuracy is not None:
        parts.append(f"held-out {progress.accuracy[1]:.1%} (step {progress.accuracy[0]})")
    if progress.lag is not None:
        parts.append(f"lag {progress.lag:.2f} (max {progress.lag_max:g})")
    if progress.steps_per_s is not None:
        parts.append(f"{progress.steps_per_s:.2f} steps/s")
    timing = duration(progress.seconds)
    if progress.seconds_left is not None:
        timing += f", {duration(progress.seconds_left)} left"
    return "  ".join([*parts, timing])


def _scalar(metrics: dict[str, Any], name: str) -> float | None:
    value = metrics.get(name)
    value = None if value is None else float(value)
    return None if value is None or math.isnan(value) else value


class RunRecord(Callback):
    """What the console reports about this process's part of a run: its first step and start time, the largest
    sample lag trained, and :meth:`progress` for a line or the summary. A bar feeds the record it is given (or its
    own); the command line also registers the one it shares, so the summary has it without a bar. Feeding it twice
    a step changes nothing: the start is taken again within the same instant, the largest lag is a maximum."""

    def __init__(self) -> None:
        self.first_step: int | None = None
        self.started: float | None = None
        self.lag_max: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.first_step, self.started = trainer.global_step, time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        lag_max = _scalar(trainer.callback_metrics, LAG_MAX)
        if lag_max is not None:
            self.lag_max = lag_max if self.lag_max is None else max(self.lag_max, lag_max)

    def progress(self, trainer: pl.Trainer) -> Progress:
        metrics = trainer.callback_metrics
        evaluation = next((c for c in trainer.callbacks if isinstance(c, HeldOutEvaluation)), None)
        first = trainer.global_step if self.first_step is None else self.first_step
        return Progress(
            step=trainer.global_step,
            max_steps=trainer.max_steps,
            steps_done=trainer.global_step - first,
            seconds=0.0 if self.started is None else time.perf_counter() - self.started,
            reward=_scalar(metrics, REWARD),
            accuracy=evaluation.history[-1] if evaluation is not None and evaluation.history else None,
            lag=_scalar(metrics, LAG_MEAN),
            lag_max=self.lag_max,
        )


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar counting optimizer steps out of ``max_steps``, resumed runs included. The
    prompt stream is endless, so Lightning's "Epoch 0/-2" (``max_epochs=-1``) and its count of the batches left
    say nothing; nor does the logger's version shown as a metric ("v_num: 0.000"). Shows the sample lag under
    ``sampler.asynchronous``."""

    def __init__(self, record: RunRecord | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.record = record or RunRecord()

    def _get_train_description(self, current_epoch: int) -> str:
        return "optimizer steps"

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self.trainer.max_steps > 0 else super().total_train_batches

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        lag = _scalar(trainer.callback_metrics, LAG_MEAN)
        if lag is not None:
            metrics["lag"] = f"{lag:.2f}"
        return metrics

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self.record.on_train_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._update(self.train_progress_bar_id, trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.record.on_train_batch_end(trainer, pl_module)
        if not self.is_disabled and self.train_progress_bar_id is None:  # a run resumed within its endless epoch
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()


class PlainProgress(ProgressBar):
    """One line of progress every ``every_seconds`` (and every ``every_n_steps``, when set), after the first step
    and at the last: where a bar cannot draw (stdout not a terminal), so a batch job's log shows the run going.

    Args:
        every_seconds: seconds between two lines at most (the line is printed at the next optimizer step).
        every_n_steps: also print every this many optimizer steps (0: by time only).
        record: the run's record (the command line's); by default the bar keeps its own.
    """

    def __init__(self, every_seconds: float = 30.0, every_n_steps: int = 0, record: RunRecord | None = None) -> None:
        super().__init__()
        if every_seconds <= 0 or every_n_steps < 0:
            raise ValueError(f"PlainProgress needs every_seconds > 0 and every_n_steps >= 0, got "
                             f"{every_seconds!r} and {every_n_steps!r}")  # fmt: skip
        self.every_seconds, self.every_n_steps = every_seconds, every_n_steps
        self.record = record or RunRecord()
        self._enabled = True
        self._last_line: float | None = None

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record.on_train_start(trainer, pl_module)
        self._last_line = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.record.on_train_batch_end(trainer, pl_module)
        if not (self._enabled and trainer.is_global_zero):
            return
        now, step = time.perf_counter(), trainer.global_step
        due = (
            self._last_line is None  # the first step of this process: the run is going
            or now - self._last_line >= self.every_seconds
            or (self.every_n_steps and step % self.every_n_steps == 0)
            or (0 < trainer.max_steps <= step)
        )
        if due:
            self.print(progress_line(self.record.progress(trainer)))
            self._last_line = now

    def print(self, *args: Any, **kwargs: Any) -> None:
        print(*args, **kwargs, flush=True)


def progress_bar(record: RunRecord, stream: Any = None) -> ProgressBar:
    """The bar for ``stream`` (stdout): rich's on a terminal (when rich is installed), plain lines otherwise."""
    stream = sys.stdout if stream is None else stream
    if stream.isatty() and importlib.util.find_spec("rich") is not None:
        return StepProgressBar(record)
    return PlainProgress(record=record)
