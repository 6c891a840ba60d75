"""``python -m gspo_lightning fit --help``: the main settings first, each with the first line of its docstring, then
jsonargparse's full reference of every setting.

The full reference is LightningCLI's: some 900 lines that open with the Trainer's 45 flags, and the module's and
data's settings (``model.init_args.*``, ``data.init_args.*``) are not in it at all (their classes are chosen by
``class_path``; ``--model.help GSPOModule`` lists them). :data:`MAIN_SETTINGS` is what a new user looks for; its
help is read from the same docstrings the full reference prints, so the two never disagree.
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import Trainer

from gspo_lightning.data import PromptDataModule
from gspo_lightning.module import GSPOModule
from gspo_lightning.sampling import GroupSampler, HeldOutEvaluation

PROGRAM = "python -m gspo_lightning"
"""The program's name in usage lines (``gspo-lightning``, the installed script, when run as that)."""
SCRIPT = "gspo-lightning"
DESCRIPTION = (
    "GSPO training for language models on PyTorch Lightning. Start with:\n"
    "  python -m gspo_lightning fit -c configs/quickstart.yaml\n"
    "'fit --help' opens with the main settings; 'plot <run folder>' draws a run's metrics."
)
"""The top-level ``--help``'s description (LightningCLI's is "Lightning Trainer command line tool")."""
FIT_USAGE = "%(prog)s -c CONFIG [--ckpt_path CKPT] [--KEY VALUE ...]"
"""``fit``'s usage line: argparse's own lists every option (45 lines of Trainer flags before the first of ours)."""


@dataclass(frozen=True)
class MainSetting:
    """One row of the main settings: the flag, and where its help comes from (a class's parameter docstring, or
    ``text`` for the flags that belong to no class)."""

    flag: str
    owner: type | None = None
    parameter: str = ""
    text: str = ""


MAIN_SETTINGS = [
    MainSetting("-c, --config CONFIG", text="a YAML config; several merge in order, the later winning"),
    MainSetting("--ckpt_path CKPT", text="resume: last (the run's newest last.ckpt) or a path"),
    MainSetting("--trainer.max_steps", Trainer, "max_steps"),
    MainSetting("--model.init_args.policy", GSPOModule, "policy"),
    MainSetting("--model.init_args.objective", GSPOModule, "objective"),
    MainSetting("--model.init_args.max_new_tokens", GSPOModule, "max_new_tokens"),
    MainSetting("--model.init_args.temperature", GSPOModule, "temperature"),
    MainSetting("--optimizer.init_args.lr", text="learning rate (default 1e-6) of --optimizer (AdamW)"),
    MainSetting("--lr_scheduler", text="a schedule, e.g. gspo_lightning.schedules.CosineWithWarmup"),
    MainSetting("--data.init_args.source", PromptDataModule, "source"),
    MainSetting("--data.init_args.prompt_template", PromptDataModule, "prompt_template"),
    MainSetting("--data.init_args.prompts_per_rollout", PromptDataModule, "prompts_per_rollout"),
    MainSetting("--sampler.rewards", GroupSampler, "rewards"),
    MainSetting("--sampler.group_size", GroupSampler, "group_size"),
    MainSetting("--sampler.num_minibatches", GroupSampler, "num_minibatches"),
    MainSetting("--sampler.engine", GroupSampler, "engine"),
    MainSetting("--sampler.episodes", GroupSampler, "episodes"),
    MainSetting("--evaluation.correct", HeldOutEvaluation, "correct"),
    MainSetting("--evaluation.every_n_steps", HeldOutEvaluation, "every_n_steps"),
    MainSetting("--trainer.logger.init_args.name", text="the run's name: it writes to runs/<name>/version_<n>"),
]
"""What a new user looks for first, in the order a run is read: config, model, optimizer, data, sampling,
evaluation, where it writes."""


def program_name(argv0: str | None = None) -> str:
    """``gspo-lightning`` when run as the installed script, else ``python -m gspo_lightning``."""
    name = Path(argv0 if argv0 is not None else sys.argv[0]).name
    return SCRIPT if name == SCRIPT else PROGRAM


class HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's formatter, with the description and epilog printed as written (they are tables)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


def main_settings_text(settings: list[MainSetting], width: int | None = None) -> str:
    """The table that opens ``fit --help``: one line per setting, its flag and the first sentence of its help
    (shortened to the terminal's ``width``), then where the rest is."""
    width = width if width is not None else min(max(shutil.get_terminal_size().columns, 80), 160)
    column = max(len(setting.flag) for setting in settings) + 2
    lines = ["Main settings (--KEY VALUE on the command line, or KEY: VALUE in a -c config such as",
             "configs/quickstart.yaml; a nested KEY is a YAML mapping, model: {init_args: {objective: gspo}}):"]
    for setting in settings:
        lines.append(f"  {setting.flag:<{column}}{first_sentence(help_of(setting), width - column - 2)}")
    lines += [
        "",
        "Every setting follows under 'options'. A class's own settings: --model.help GSPOModule,",
        "--data.help PromptDataModule, --model.init_args.policy.help Pretrained,",
        "--sampler.engine.help HFEngine; the config a run would use: --print_config.",
    ]
    return "\n".join(lines)


def help_of(setting: MainSetting) -> str:
    """The setting's help: its class's docstring for the parameter, else its ``text``."""
    if setting.owner is None:
        return setting.text
    return parameter_docs(setting.owner).get(setting.parameter) or setting.text


def parameter_docs(owner: type) -> dict[str, str]:
    """Each parameter of ``owner`` -> its docstring text, as jsonargparse reads it for the full reference."""
    try:
        from jsonargparse._parameter_resolvers import get_signature_parameters

        return {param.name: param.doc or "" for param in get_signature_parameters(owner)}
    except Exception:  # noqa: BLE001 - a newer jsonargparse moved it: the table keeps its flags, without help
        return {}


def first_sentence(text: str, width: int) -> str:
    """``text``'s first sentence on one line, literal markup dropped, shortened to ``width`` characters."""
    text = re.sub(r"\s+", " ", text.replace("``", "")).strip()
    sentence = re.split(r"(?<=[a-z0-9)])(?<!\be\.g)(?<!\bi\.e)\. ", text, maxsplit=1)[0].rstrip(".")
    if len(sentence) <= width:
        return sentence
    cut = sentence[: max(width - 4, 10)].rsplit(" ", 1)[0].rstrip(",;:(")
    return f"{cut} ..."
