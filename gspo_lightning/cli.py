"""``python -m gspo_lightning fit -c config.yaml``: LightningCLI with the sampler wired to the module."""

from __future__ import annotations

import copy
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, TypeVar

import yaml
from jsonargparse import ArgumentError
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from gspo_lightning.callbacks import CheckpointOnPreemption, ExportPolicy, LogCompletions, NonFiniteGuard
from gspo_lightning.cli_errors import describe_argument_error, one_line, user_code_report
from gspo_lightning.cli_help import (
    DESCRIPTION,
    FIT_USAGE,
    MAIN_SETTINGS,
    HelpFormatter,
    main_settings_text,
    program_name,
)
from gspo_lightning.console import configure_console
from gspo_lightning.data import PromptDataModule
from gspo_lightning.interrupt import STOPPED_BY_CTRL_C, StopOnInterrupt
from gspo_lightning.module import GSPOModule
from gspo_lightning.process_group import close_process_group
from gspo_lightning.progress import RunRecord, progress_bar
from gspo_lightning.sampling import GroupSampler, HeldOutEvaluation
from gspo_lightning.run_dirs import new_run_folder, remove_if_nothing_of_value, resolve_resume
from gspo_lightning.summary import RunOutcome, resume_command, rollout_mode, summary_text
from gspo_lightning.validation import SettingError, UserError

T = TypeVar("T")
BASE_CONFIG = Path(__file__).with_name("base.yaml")
"""Loaded before any ``-c`` config (``configs/base.yaml`` links to it)."""
CALLBACK_GROUPS = {
    "sampler": GroupSampler,
    "evaluation": HeldOutEvaluation,
    "export": ExportPolicy,
    "nonfinite": NonFiniteGuard,
    "preemption": CheckpointOnPreemption,
    "completions": LogCompletions,
}
"""The callbacks every run has, each under its own top-level key."""
GROUPS: dict[str, type] = {"trainer": Trainer, "model": GSPOModule, "data": PromptDataModule, **CALLBACK_GROUPS}
"""The class each top-level key's settings go to (the default class of ``model`` and ``data``)."""
DEFAULT_OPTIMIZER = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1.0e-6, "weight_decay": 0.0}}
"""``--optimizer``'s default, GSPOModule's own: AdamW at lr 1e-6 (the paper's scale), no weight decay."""


def composed_config(*paths: str | Path) -> dict[str, Any]:
    """``base.yaml`` and then each config of ``paths`` merged as the command line merges them (mappings key by key,
    a list or a different ``class_path`` replacing what was there), as one dict: to edit a config in code."""
    composed: dict[str, Any] = {"optimizer": copy.deepcopy(DEFAULT_OPTIMIZER)}  # the parser's own default
    for path in (BASE_CONFIG, *paths):
        composed = _merged(composed, yaml.safe_load(Path(path).read_text()) or {})
    return composed


def _merged(base: Any, update: Any) -> Any:
    if not (isinstance(base, dict) and isinstance(update, dict)):
        return copy.deepcopy(update)
    if "class_path" in update and update["class_path"] != base.get("class_path"):
        return copy.deepcopy(update)
    return {**base, **{key: _merged(base.get(key), value) for key, value in update.items()}}


class ConfigError(SettingError):
    """A setting that cannot work, found while the config is read and its objects built; one line of message."""


class GSPOCLI(LightningCLI):
    """LightningCLI whose sampler, evaluation, export and fault callbacks are always present, shared values linked."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for key, callback in CALLBACK_GROUPS.items():
            parser.add_lightning_class_args(callback, key)
        # LightningCLI's own --optimizer builds the optimizer before configure_model has built the policy; these
        # reach GSPOModule, which builds them over the trainable parameters (the only ones LoRA trains).
        parser.add_argument(
            "--optimizer", type=OptimizerCallable, default=DEFAULT_OPTIMIZER,
            help="the optimizer, any torch.optim class (e.g. AdamW with betas) or bitsandbytes.optim.AdamW8bit",
        )  # fmt: skip
        parser.add_argument(
            "--lr_scheduler", type=LRSchedulerCallable | None, default=None,
            help="a learning-rate schedule stepped every optimizer step (gspo_lightning.schedules.LinearWarmup, "
            "CosineWithWarmup, or any torch.optim.lr_scheduler class); null: constant",
        )  # fmt: skip
        parser.link_arguments("optimizer", "model.init_args.optimizer")
        parser.link_arguments("lr_scheduler", "model.init_args.lr_scheduler")
        # Linked, not interpolated: a command-line override of the source reaches every target.
        parser.link_arguments("sampler.num_minibatches", "data.init_args.minibatches_per_rollout")
        parser.link_arguments("sampler.prompt_overflow", "evaluation.prompt_overflow")

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        super().parse_arguments(parser, args)
        # Kept before LightningCLI merges a checkpoint's hyper-parameters over the command line (--ckpt_path):
        # the command line must win, and GSPOModule.on_load_checkpoint refuses what cannot change.
        self._command_line_config = copy.deepcopy(self.config)

    def before_instantiate_classes(self) -> None:
        """Where ``--ckpt_path last`` points, and a resumed run's module settings as the command line gives them (every
        other setting is checked by the object it configures, when it is built or set up)."""
        try:
            config = self.config[self.subcommand] if self.subcommand else self.config
            if self.subcommand == "fit" and resolve_resume(config):  # last: the run's newest last.ckpt, in its folder
                # the resumed run's own checkpoints are there, as they should be
                warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            if self.subcommand and config.get("ckpt_path"):
                config.model = self._command_line_config[self.subcommand].model
        except ValueError as error:
            raise ConfigError(one_line(error)) from error

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, ImportError) as error:  # a bad setting, or an optional dependency it needs
            raise ConfigError(one_line(error)) from error

    def _run_subcommand(self, subcommand: str) -> None:
        """The subcommand; on failure (an error, Ctrl-C) the run folder removed again when this run created it and
        wrote nothing of value into it (see :mod:`gspo_lightning.run_dirs`); a run stopped by Ctrl-C or SIGTERM
        ends with the summary, where it stopped and how to resume it (Ctrl-C: exit status 130)."""
        created = new_run_folder(self.trainer)
        try:
            super()._run_subcommand(subcommand)
        except BaseException as error:
            remove_if_nothing_of_value(created)
            stopped_by = _stopped_by(error, self._stopper.interrupted)
            if subcommand != "fit" or stopped_by is None:
                raise
            self.after_fit(stopped_by)
            if stopped_by == "Ctrl-C":
                sys.exit(STOPPED_BY_CTRL_C)
            raise

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Lightning's trainer, with the console's record of the run, Ctrl-C stopping at a step's end with a
        checkpoint (:mod:`gspo_lightning.interrupt`) and a progress bar counting optimizer steps: rich's on a
        terminal, a line every 30 s otherwise (:mod:`gspo_lightning.progress`)."""
        trainer = self.config_init[self.subcommand].trainer if self.subcommand else self.config_init.trainer
        self._record, self._stopper = RunRecord(), StopOnInterrupt()
        callbacks = [*(trainer.get("callbacks") or []), self._record, self._stopper]
        wanted = trainer.get("enable_progress_bar") is not False
        if wanted and not any(isinstance(callback, ProgressBar) for callback in callbacks):
            callbacks.append(progress_bar(self._record))
        trainer.callbacks = callbacks
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        self._fit_started = time.perf_counter()
        sampler = _callback(self.trainer, GroupSampler)
        if sampler.asynchronous.enabled and rank_zero_only.rank == 0:
            print(f"rollouts: {rollout_mode(sampler.asynchronous)}", flush=True)

    def after_fit(self, stopped_by: str | None = None) -> None:
        # every rank: log_dir is a collective
        outcome = self.outcome(time.perf_counter() - self._fit_started, stopped_by)
        if rank_zero_only.rank == 0:
            print(summary_text(outcome), flush=True)

    def outcome(self, seconds: float, stopped_by: str | None = None) -> RunOutcome:
        """What the summary reports: did it learn, where are the files, and where a stopped run stopped."""
        trainer = self.trainer
        evaluation, export = _callback(trainer, HeldOutEvaluation), _callback(trainer, ExportPolicy)
        checkpoint = trainer.checkpoint_callback
        newest = _callback(trainer, CheckpointOnPreemption).saved_to  # the command line always has these callbacks
        if newest is None and isinstance(checkpoint, ModelCheckpoint) and checkpoint.last_model_path:
            newest = checkpoint.last_model_path
        return RunOutcome(
            progress=self._record.progress(trainer),
            seconds=seconds,
            log_dir=trainer.log_dir,
            checkpoint=newest,
            exported_to=export.exported_to,
            evaluation=evaluation.description,
            history=list(evaluation.history),
            asynchronous=_callback(trainer, GroupSampler).asynchronous,
            stopped_by=stopped_by,
            resume=resume_command(program_name(), sys.argv[1:]) if stopped_by else None,
        )


def _callback(trainer: Trainer, kind: type[T]) -> T:
    """The trainer's callback of ``kind``: one of the command line's own (``CALLBACK_GROUPS``), always there."""
    return next(callback for callback in trainer.callbacks if isinstance(callback, kind))


def _stopped_by(error: BaseException, interrupted: bool) -> str | None:
    """``Ctrl-C`` or ``SIGTERM`` when ``error`` is how Lightning ends a run stopped by one, else None."""
    if interrupted or isinstance(error, KeyboardInterrupt) or isinstance(error.__context__, KeyboardInterrupt):
        return "Ctrl-C"  # the first one (a SIGTERMException), or a second one or one before training started
    return "SIGTERM" if isinstance(error, SIGTERMException) else None


def command_line() -> None:
    """``python -m gspo_lightning`` and ``gspo-lightning``: LightningCLI's subcommands (``fit``, ...) and ``plot``
    (see :mod:`gspo_lightning.plot`). A mistake in the settings or the data ends the run with one line naming it,
    the user's reward, tool or environment raising with one line naming its setting and the error, then the user's
    own frames (``GSPO_LIGHTNING_TRACEBACK=1`` shows the whole traceback); a bug keeps its traceback."""
    if sys.argv[1:2] == ["plot"]:  # not a Trainer subcommand: draws a finished (or running) run's metrics
        from gspo_lightning.plot import main as plot

        plot(sys.argv[2:])
        return
    configure_console()
    try:
        main()
    except ArgumentError as error:
        _exit_with(error, describe_argument_error(str(error), GROUPS, sys.argv[1:]), status=2)
    except UserError as error:
        _exit_with(error, one_line(error))
    except Exception as error:  # a reward, tool or environment of the user's raised: that line, the user's frames
        report = user_code_report(error, bool(os.environ.get("GSPO_LIGHTNING_TRACEBACK")), rank_zero_only.rank)
        if report is None:
            raise
        print(report, file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        close_process_group()


def _exit_with(error: Exception, line: str, status: int = 1) -> None:
    if os.environ.get("GSPO_LIGHTNING_TRACEBACK"):
        raise error
    print(f"error: {line}", file=sys.stderr, flush=True)
    sys.exit(status)


def main(args: list[str] | None = None, run: bool = True) -> GSPOCLI:
    """The command-line entry point; ``args`` and ``run=False`` let tests and notebooks build the objects."""
    return GSPOCLI(
        GSPOModule,
        PromptDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs=_parser_kwargs(run),
        auto_configure_optimizers=False,  # GSPOCLI's --optimizer / --lr_scheduler reach the module instead
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def _parser_kwargs(subcommands: bool) -> dict[str, Any]:
    """omegaconf interpolation, and base.yaml read first (the trainer's logging and checkpointing, which a task
    config then only overrides), by every subcommand's parser, or the one parser without subcommands; ``fit``'s
    help opening with the main settings (:mod:`gspo_lightning.cli_help`)."""
    # exit_on_error=False: a parsing error reaches command_line as an exception, printed as one line
    base = {"default_config_files": [str(BASE_CONFIG)], "exit_on_error": False}
    fit_help = {"usage": FIT_USAGE, "description": main_settings_text(MAIN_SETTINGS)}
    per_parser = {name: base | (fit_help if name == "fit" else {}) for name in LightningCLI.subcommands()}
    main_parser = {"prog": program_name(), "description": DESCRIPTION, "formatter_class": HelpFormatter}
    return {**main_parser, "parser_mode": "omegaconf", "exit_on_error": False, **(per_parser if subcommands else base)}
