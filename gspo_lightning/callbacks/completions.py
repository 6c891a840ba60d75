"""LogCompletions: what the policy actually wrote, next to the rewards and advantages it was trained with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

from gspo_lightning.sampling.sampler import GroupSampler
from gspo_lightning.rollout.types import Prompt, Rollout
from gspo_lightning.validation import require


class LogCompletions(Callback):
    """Every ``every_n_steps`` optimizer steps, a table of the latest round's samples: prompt, completion, each
    reward function's score, the combined reward and the advantage trained with (after any KL penalty).

    Rank 0's round, its first ``max_rows`` responses (whole groups when ``max_rows`` is a multiple of G), is
    appended to ``<log dir>/completions.jsonl`` (one JSON object per sample, with its ``step``), and shown as a
    text table on a ``TensorBoardLogger`` and as a ``wandb.Table`` on a ``WandbLogger``. A round is logged at its
    first optimizer step, the first at or after each multiple of ``every_n_steps``.

    Args:
        every_n_steps: how often, in optimizer steps (0 disables it).
        max_rows: samples per table (>= 1).
        max_chars: longer prompts and completions are cut to this many characters (>= 1), marked with "...".
    """

    def __init__(self, every_n_steps: int = 50, max_rows: int = 16, max_chars: int = 2000) -> None:
        require(
            isinstance(every_n_steps, int) and every_n_steps >= 0,
            f"completions.every_n_steps must be an integer >= 0 (0 disables it), got {every_n_steps!r}",
        )
        require(isinstance(max_rows, int) and max_rows >= 1, f"completions.max_rows must be >= 1, got {max_rows!r}")
        require(isinstance(max_chars, int) and max_chars >= 1, f"completions.max_chars must be >= 1, got {max_chars!r}")
        self.every_n_steps = every_n_steps
        self.max_rows = max_rows
        self.max_chars = max_chars
        self._next_step = 0

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step - 1  # the optimizer step this batch just took
        if not self.every_n_steps or getattr(batch, "minibatch_index", 0) != 0 or step < self._next_step:
            return
        self._next_step = (step // self.every_n_steps + 1) * self.every_n_steps
        sampler = next((c for c in trainer.callbacks if isinstance(c, GroupSampler)), None)
        log_dir = trainer.log_dir  # a collective under some strategies: every rank asks
        if sampler is None or sampler.last_rollout is None or not trainer.is_global_zero:
            return
        rows = completion_rows(sampler.last_rollout, self.max_rows, self.max_chars)
        write_rows(Path(log_dir or trainer.default_root_dir) / "completions.jsonl", step, rows)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("completions", markdown_table(rows), step)
            elif isinstance(logger, WandbLogger):
                columns = list(rows[0])
                logger.log_table("completions", columns=columns, data=[list(r.values()) for r in rows], step=step)

    def state_dict(self) -> dict[str, int]:
        return {"next_step": self._next_step}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._next_step = state_dict["next_step"]


def completion_rows(rollout: Rollout, max_rows: int, max_chars: int) -> list[dict[str, Any]]:
    """The first ``max_rows`` samples of ``rollout`` as table rows (texts cut to ``max_chars``)."""
    rows = []
    for i in range(min(max_rows, len(rollout.completions))):
        prompt = rollout.prompts[i] if i < len(rollout.prompts) else ""
        row: dict[str, Any] = {"prompt": _cut(_prompt_text(prompt), max_chars),
                               "completion": _cut(rollout.completions[i], max_chars)}  # fmt: skip
        row |= {f"reward/{name}": float(scores[i]) for name, scores in rollout.reward_components.items()}
        row |= {"reward": float(rollout.rewards[i]), "advantage": float(rollout.advantages[i])}
        rows.append(row)
    return rows


def write_rows(path: Path, step: int, rows: list[dict[str, Any]]) -> None:
    """Append ``rows`` to a JSONL file, each with its ``step``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps({"step": step} | row, ensure_ascii=False) + "\n")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """``rows`` as a Markdown table (TensorBoard renders its text summaries as Markdown)."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{value:.4g}" if isinstance(value, float) else str(value) for value in row.values()]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", "<br>") for c in cells) + " |")
    return "\n".join(lines)


def _prompt_text(prompt: Prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{message.get('role', '')}: {message.get('content', '')}" for message in prompt)


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + "..."
