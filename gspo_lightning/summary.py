"""The run summary the command line prints when a run ends or is stopped: did it learn, where are the files, and
for a stopped run where it stopped and the command that resumes it. Pure functions of :class:`RunOutcome`."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from gspo_lightning.asynchronous import AsyncRollouts
from gspo_lightning.progress import Progress, duration


@dataclass(frozen=True)
class RunOutcome:
    """What the summary reports, gathered by the command line from the trainer and its callbacks."""

    progress: Progress
    seconds: float  # the whole fit's, setup and warm start included
    log_dir: str | None = None
    checkpoint: str | None = None  # the newest checkpoint of the run, if any
    exported_to: str | None = None
    evaluation: str = "held-out accuracy"  # what the history measures
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, value) of every evaluation
    asynchronous: AsyncRollouts = field(default_factory=AsyncRollouts)
    stopped_by: str | None = None  # "Ctrl-C", "SIGTERM": the run did not reach its end
    resume: str | None = None  # the command that resumes a stopped run


def resume_command(program: str, argv: list[str]) -> str:
    """The command line ``argv`` (after the program) with ``--ckpt_path last`` in place of any ``--ckpt_path``,
    quoted for a POSIX shell."""
    kept, skip = [], False
    for argument in argv:
        if skip:
            skip = False
        elif argument == "--ckpt_path":
            skip = True
        elif not argument.startswith("--ckpt_path="):
            kept.append(argument)
    return " ".join([program, *(shlex.quote(argument) for argument in [*kept, "--ckpt_path", "last"])])


def rollout_mode(settings: AsyncRollouts) -> str:
    """``fixed lag 1 (sampler.asynchronous.lag)``: how far sampling runs ahead, as the start line and summary say."""
    if not settings.enabled:
        return "on-policy (each round sampled with the weights it trains)"
    if settings.mode == "fixed_lag":
        return f"asynchronous, fixed lag {settings.lag} ({settings.bound_setting})"
    return (
        f"asynchronous, streaming in chunks of {settings.chunk_tokens} tokens, max_staleness "
        f"{settings.max_staleness} ({settings.bound_setting})"
    )


def summary_text(outcome: RunOutcome) -> str:
    """The summary's lines, starting with an empty one and the heading."""
    progress = outcome.progress
    heading = "=== gspo_lightning run summary ==="
    if outcome.stopped_by:
        heading = f"=== gspo_lightning run summary: stopped by {outcome.stopped_by} at step {progress.step} ==="
    lines = ["", heading]
    if len(outcome.history) == 1:
        lines.append(f"{outcome.evaluation}: {outcome.history[0][1]:.1%} (step {outcome.history[0][0]})")
    elif outcome.history:
        (first_step, first), (last_step, last) = outcome.history[0], outcome.history[-1]
        lines.append(
            f"{outcome.evaluation}: {first:.1%} (step {first_step}) -> {last:.1%} (step {last_step}), "
            f"{(last - first) * 100:+.1f} points"
        )
    of_max = f" of {progress.max_steps}" if progress.max_steps > 0 and outcome.stopped_by else ""
    lines.append(f"optimizer steps: {progress.step}{of_max}   time: {duration(outcome.seconds)}")
    if outcome.asynchronous.enabled:
        versions = "version" if progress.lag_max == 1 else "versions"
        lag = "" if progress.lag_max is None else f"; trained tokens at most {progress.lag_max:g} {versions} old"
        lines.append(f"rollouts: {rollout_mode(outcome.asynchronous)}{lag}")
    if outcome.log_dir:
        lines.append(f"logs: {outcome.log_dir}")
    if outcome.checkpoint:
        lines.append(f"last checkpoint: {outcome.checkpoint}")
    if outcome.exported_to:
        lines.append(f"exported policy (from_pretrained): {outcome.exported_to}")
    if outcome.stopped_by:
        if outcome.checkpoint and outcome.resume:
            lines.append(f"resume with: {outcome.resume}")
        else:
            lines.append("no checkpoint was saved: the same command starts the run again")
    return "\n".join(lines)
