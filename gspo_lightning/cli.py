"""``python -m gspo_lightning fit -c config.yaml``: LightningCLI with the sampler wired to the module."""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ArgumentError
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_only

from gspo_lightning.callbacks import CheckpointOnPreemption, ExportPolicy, LogCompletions, NonFiniteGuard
from gspo_lightning.cli_errors import describe_argument_error, one_line
from gspo_lightning.cli_help import (
    DESCRIPTION,
    FIT_USAGE,
    MAIN_SETTINGS,
    HelpFormatter,
    main_settings_text,
    program_name,
)
from gspo_lightning.console import StepProgressBar, quiet_library_noise
from gspo_lightning.data import PromptDataModule
from gspo_lightning.module import GSPOModule
from gspo_lightning.process_group import close_process_group
from gspo_lightning.rollout import GroupSampler, HeldOutEvaluation
from gspo_lightning.run_dirs import new_run_folder, remove_if_nothing_of_value, resolve_resume
from gspo_lightning.validation import SettingError, UserError

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
        """The subcommand, and on failure (an error, Ctrl-C) the run folder removed again when this run created it
        and wrote nothing of value into it (see :mod:`gspo_lightning.run_dirs`)."""
        created = new_run_folder(self.trainer)
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            remove_if_nothing_of_value(created)
            raise

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Lightning's trainer, with rich's progress bar counting optimizer steps when rich is installed."""
        trainer = self.config_init[self.subcommand].trainer if self.subcommand else self.config_init.trainer
        callbacks = trainer.get("callbacks") or []
        wanted = trainer.get("enable_progress_bar") is not False and importlib.util.find_spec("rich") is not None
        if wanted and not any(isinstance(callback, ProgressBar) for callback in callbacks):
            trainer.callbacks = [*callbacks, StepProgressBar()]
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        self._fit_started = time.perf_counter()

    def after_fit(self) -> None:
        summary = self.summary(time.perf_counter() - self._fit_started)  # every rank: log_dir is a collective
        if rank_zero_only.rank == 0:
            print(summary, flush=True)

    def summary(self, seconds: float) -> str:
        """What a user wants to know when the run ends: did it learn, and where are the files."""
        trainer = self.trainer
        evaluation = next(c for c in trainer.callbacks if isinstance(c, HeldOutEvaluation))
        export = next(c for c in trainer.callbacks if isinstance(c, ExportPolicy))
        checkpoint = trainer.checkpoint_callback
        lines = ["", "=== gspo_lightning run summary ==="]
        if evaluation.history:
            (first_step, first), (last_step, last) = evaluation.history[0], evaluation.history[-1]
            lines.append(
                f"{evaluation.description}: {first:.1%} (step {first_step}) -> {last:.1%} (step {last_step}), "
                f"{(last - first) * 100:+.1f} points"
            )
        lines.append(f"optimizer steps: {trainer.global_step}   time: {seconds:.0f} s")
        lines.append(f"logs: {trainer.log_dir}")
        if isinstance(checkpoint, ModelCheckpoint) and checkpoint.last_model_path:
            lines.append(f"last checkpoint: {checkpoint.last_model_path}")
        if export.exported_to:
            lines.append(f"exported policy (from_pretrained): {export.exported_to}")
        return "\n".join(lines)


def command_line() -> None:
    """``python -m gspo_lightning`` and ``gspo-lightning``: LightningCLI's subcommands (``fit``, ...) and ``plot``
    (see :mod:`gspo_lightning.plot`). A mistake in the settings or the data ends the run with one line naming it
    (``GSPO_LIGHTNING_TRACEBACK=1`` shows the traceback too); a bug keeps its traceback."""
    if sys.argv[1:2] == ["plot"]:  # not a Trainer subcommand: draws a finished (or running) run's metrics
        from gspo_lightning.plot import main as plot

        plot(sys.argv[2:])
        return
    quiet_library_noise()
    try:
        main()
    except ArgumentError as error:
        _exit_with(error, describe_argument_error(str(error), GROUPS, sys.argv[1:]), status=2)
    except UserError as error:
        _exit_with(error, one_line(error))
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
