"""``fit --help`` opens with the main settings, each with its docstring's first sentence, under the program's name."""

from __future__ import annotations

import sys

import pytest

from gspo_lightning.cli import command_line
from gspo_lightning.cli_help import MAIN_SETTINGS, first_sentence, help_of, parameter_docs, program_name

WANTED = ["--config", "--ckpt_path", "--trainer.max_steps", "--model.init_args.policy", "--model.init_args.objective",
          "--model.init_args.max_new_tokens", "--model.init_args.temperature", "--optimizer.init_args.lr",
          "--data.init_args.source", "--data.init_args.prompts_per_rollout", "--sampler.group_size",
          "--sampler.engine", "--sampler.rewards"]  # fmt: skip


def _help(arguments: list[str], monkeypatch, capsys) -> list[str]:
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys, "argv", ["/somewhere/gspo_lightning/__main__.py", *arguments])
    with pytest.raises(SystemExit) as exit_:
        command_line()
    assert exit_.value.code == 0
    return capsys.readouterr().out.splitlines()


def test_the_first_screen_of_fit_help_lists_the_main_settings_with_their_help(monkeypatch, capsys):
    lines = _help(["fit", "--help"], monkeypatch, capsys)
    assert lines[0].startswith("usage: python -m gspo_lightning [options] fit -c CONFIG")
    screen = lines[:40]
    for flag in WANTED:
        row = next((line for line in screen if line.strip().split(" ")[0].rstrip(",") in (flag, "-c")
                    and flag in line), None)  # fmt: skip
        assert row is not None, f"{flag} is not in the first 40 lines of fit --help"
        assert len(row.split(flag, 1)[1].strip()) > 10, f"{flag} has no help: {row!r}"
    assert "objective's name (gspo, gspo_token" in "\n".join(screen)  # GSPOModule's docstring, literal marks dropped
    ours = screen[: next(i for i, line in enumerate(screen) if line.startswith("default config file"))]
    assert all(len(line) <= 100 for line in ours)
    assert "options:" in lines and any(line.startswith("  --trainer.accelerator") for line in lines)  # all of it


def test_the_top_level_help_names_the_program_and_the_first_command(monkeypatch, capsys):
    lines = _help(["--help"], monkeypatch, capsys)
    assert lines[0].startswith("usage: python -m gspo_lightning ")
    assert "  python -m gspo_lightning fit -c configs/quickstart.yaml" in lines


def test_the_installed_script_is_named_as_it_is_run():
    assert program_name("/venv/bin/gspo-lightning") == "gspo-lightning"
    assert program_name("/repo/gspo_lightning/__main__.py") == "python -m gspo_lightning"


@pytest.mark.parametrize("setting", [s for s in MAIN_SETTINGS if s.owner is not None], ids=lambda s: s.flag)
def test_every_main_setting_is_a_documented_parameter_of_its_class(setting):
    """A renamed or undocumented parameter fails here, not as an empty row of the help."""
    assert setting.flag.rsplit(".", 1)[-1] == setting.parameter
    assert parameter_docs(setting.owner).get(setting.parameter), f"{setting.owner.__name__}.{setting.parameter}"
    assert help_of(setting)


def test_a_first_sentence_is_one_shortened_line():
    assert first_sentence("Where prompts come from, e.g. ``LoadDataset``.  More.", 80) == (
        "Where prompts come from, e.g. LoadDataset"
    )
    assert first_sentence("K, steps per\nbatch (4). Then more.", 80) == "K, steps per batch (4)"
    shortened = first_sentence("one two three four five six seven eight nine ten", 24)
    assert shortened == "one two three four ..." and len(shortened) <= 24
