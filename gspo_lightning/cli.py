"""``python -m gspo_lightning fit -c config.yaml``: LightningCLI with the sampler wired to the module."""

from __future__ import annotations

import time

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only

from gspo_lightning.callbacks import CheckpointOnPreemption, ExportPolicy, NonFiniteGuard
from gspo_lightning.data import PromptDataModule
from gspo_lightning.module import GSPOModule
from gspo_lightning.rollout import GroupSampler, HeldOutEvaluation
from gspo_lightning.rollout.minibatches import check_divisible


class GSPOCLI(LightningCLI):
    """LightningCLI whose sampler, evaluation, export and fault callbacks are always present, shared values linked."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(GroupSampler, "sampler")
        parser.add_lightning_class_args(HeldOutEvaluation, "evaluation")
        parser.add_lightning_class_args(ExportPolicy, "export")
        parser.add_lightning_class_args(NonFiniteGuard, "nonfinite")
        parser.add_lightning_class_args(CheckpointOnPreemption, "preemption")
        # Linked, not interpolated: a command-line override of the source reaches every target.
        parser.link_arguments("sampler.temperature", "model.init_args.temperature")
        parser.link_arguments("sampler.num_minibatches", "data.init_args.minibatches_per_rollout")
        parser.link_arguments("sampler.max_new_tokens", "evaluation.max_new_tokens")
        parser.link_arguments("sampler.max_new_tokens", "model.init_args.max_new_tokens")
        parser.link_arguments("sampler.prompt_overflow", "evaluation.prompt_overflow")

    def before_instantiate_classes(self) -> None:
        """Reject a K that does not divide P x G before anything is built."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        prompts = getattr(getattr(config.get("data"), "init_args", None), "prompts_per_rollout", None)
        if prompts is not None:
            check_divisible(prompts * config.sampler.group_size, config.sampler.num_minibatches)

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


def main(args: list[str] | None = None, run: bool = True) -> GSPOCLI:
    """The command-line entry point; ``args`` and ``run=False`` let tests and notebooks build the objects."""
    return GSPOCLI(
        GSPOModule,
        PromptDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        # A CSV logger unless the config names another: no account or extra package needed.
        trainer_defaults={"logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs"}}},
        args=args,
        run=run,
    )
