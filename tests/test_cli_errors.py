"""Every user mistake ends ``python -m gspo_lightning fit`` with one line naming the setting, a non-zero exit and no
traceback: typos (with "did you mean"), settings that moved, values a class refuses, data that cannot be read."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gspo_lightning.cli import command_line
from gspo_lightning.cli_errors import MOVED_SETTINGS
from gspo_lightning.cli_sources import setting_holding
from tests.conftest import TINY
from tests.test_cli import ROOT

QUICKSTART = str(ROOT / "configs/quickstart.yaml")
TINY_POLICY = f"--model.init_args.policy={json.dumps({'class_path': 'gspo_lightning.models.TinyQwen3', 'init_args': TINY})}"


def _loaded_from(name: str) -> str:
    return (
        "--data.init_args.source="
        + json.dumps({"class_path": "gspo_lightning.data.LoadDataset", "init_args": {"path": name, "eval_size": 2}})
    )


MISTAKES = [
    (["--sampler.group_sise=4"], 2,
     "unknown setting sampler.group_sise (gspo_lightning.sampling.sampler.GroupSampler); did you mean group_size?"),
    (["--seed_everyting=3"], 2, "unknown setting seed_everyting; did you mean seed_everything?"),
    (["--trainer.max_steps=abc"], 2, "trainer.max_steps: expected int, got 'abc'"),
    (["--model.init_args.lr=1e-4"], 2,
     "model.init_args.lr has moved: set optimizer.init_args.lr (optimizer: {class_path: torch.optim.AdamW, init_args: "
     "{lr: ...}}) instead (see CHANGELOG.md)"),
    (["--optimizer.init_args.lr=-1"], 1,
     "optimizer.init_args.lr: Invalid learning rate: -1.0 (refused by the optimizer when built)"),
    (["--optimizer.init_args.betas=[1.5, 0.9]"], 1,
     "optimizer.init_args.betas: Invalid beta parameter at index 0: 1.5 (refused by the optimizer when built)"),
    (["--sampler.num_minibatches=3"], 1,
     "sampler.num_minibatches=3 must divide the rollout batch of 256 responses (data.prompts_per_rollout x "
     "sampler.group_size); allowed: [1, 2, 4, 8, 16, 32, 64, 128, 256]"),
    (["--model.init_args.policy=gspo_lightning.models.Pretrained",
      "--model.init_args.policy.init_args.name_or_path=/nonexistent/model"], 1,
     "Pretrained.name_or_path='/nonexistent/model': no such directory (a local save_pretrained directory, or a hub "
     "name such as 'Qwen/Qwen3-0.6B')"),
    ([TINY_POLICY, _loaded_from("missing.jsonl")], 1,
     "data file 'missing.jsonl' does not exist (data.init_args.source.init_args.path)"),
    ([TINY_POLICY, _loaded_from("empty.jsonl")], 1, "data file 'empty.jsonl' has no rows"),
    ([TINY_POLICY, _loaded_from("questions.jsonl")], 1,
     "sampler.rewards: ExactAnswer reads the column(s) ['answer'], which the 'train' split of 'questions.jsonl' does "
     "not have; available columns: ['question'] (set the reward's column option, or use another data set)"),
    # a class or function path that cannot be imported: the setting as written, the path, why, the closest names
    (["--sampler.episodes={environment: {class_path: tests.episodes.envs.Countin}}"], 2,
     "sampler.episodes.environment: cannot import tests.episodes.envs.Countin: module tests.episodes.envs has no "
     "attribute Countin; did you mean tests.episodes.envs.Counting?"),
    (["--sampler.episodes={environment: {class_path: no_such_package.games.Guess}}"], 2,
     "sampler.episodes.environment: cannot import no_such_package.games.Guess: no module named no_such_package (not "
     "installed, and not on PYTHONPATH: run from the folder that holds it, or pip install it)"),
    (["--sampler.rewards=[gspo_lightning.rewards.ExactAnswer, gspo_lightning.rewards.ExactAnswr]",
      "--sampler.reward_weights=[1, 1]"], 2,
     "sampler.rewards[1]: cannot import gspo_lightning.rewards.ExactAnswr: module gspo_lightning.rewards has no "
     "attribute ExactAnswr; did you mean gspo_lightning.rewards.ExactAnswer or gspo_lightning.rewards.MathAnswer?"),
    (["--sampler.engine={class_path: gspo_lightning.engine.HFEngine}"], 2,
     "sampler.engine: cannot import gspo_lightning.engine.HFEngine: module gspo_lightning has no attribute engine; "
     "did you mean gspo_lightning.engines?"),
]  # fmt: skip


@pytest.mark.parametrize(("arguments", "status", "line"), MISTAKES, ids=[m[2][:40] for m in MISTAKES])
def test_a_mistake_is_one_line_naming_the_setting(arguments, status, line, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "questions.jsonl").write_text("".join(json.dumps({"question": f"{i}+1"}) + "\n" for i in range(40)))
    monkeypatch.setattr(sys, "argv", ["gspo_lightning", "fit", "-c", QUICKSTART, *arguments, "--trainer.max_steps=1"])
    monkeypatch.delenv("GSPO_LIGHTNING_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        command_line()
    assert exit_.value.code == status
    errors = [text for text in capsys.readouterr().err.splitlines() if text.startswith("error:")]
    assert errors == [f"error: {line}"]


YAML_MISTAKES = [
    # a config written for the previous release
    ("model:\n  init_args:\n    warmup_steps: 10\n",
     f"model.init_args.warmup_steps has moved: set {MOVED_SETTINGS['model.init_args.warmup_steps']} instead "
     "(see CHANGELOG.md)"),
    # a typo inside a nested class is matched against that class's settings
    ("model:\n  init_args:\n    policy:\n      init_args:\n        num_digitz: 3\n",
     "unknown setting model.init_args.policy.init_args.num_digitz "
     "(gspo_lightning.data.arithmetic_warm_start.WarmStartedTinyQwen3); did you mean num_digits?"),
    ("sampler:\n  group_sise: 4\n",
     "unknown setting sampler.group_sise (gspo_lightning.sampling.sampler.GroupSampler); did you mean group_size?"),
    # a class path inside a class's init_args, named with the init_args the file has
    ("model:\n  init_args:\n    policy:\n      class_path: gspo_lightning.data.WarmStartedTinyQwen\n",
     "model.init_args.policy: cannot import gspo_lightning.data.WarmStartedTinyQwen: module gspo_lightning.data has "
     "no attribute WarmStartedTinyQwen; did you mean gspo_lightning.data.WarmStartedTinyQwen3 or "
     "gspo_lightning.data.CountdownWarmStartedTinyQwen3 or gspo_lightning.data.ScratchpadWarmStartedTinyQwen3?"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "line"), YAML_MISTAKES, ids=["moved", "nested typo", "typo", "class path"])
def test_a_mistake_in_a_yaml_file_is_one_line_naming_the_key(text, line, tmp_path, monkeypatch, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text(text)
    monkeypatch.setattr(sys, "argv", ["gspo_lightning", "fit", "-c", QUICKSTART, "-c", str(config)])
    with pytest.raises(SystemExit) as exit_:
        command_line()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {line}"


def test_through_python_dash_m_the_mistake_is_the_only_thing_on_stderr(tmp_path):
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    environment.pop("GSPO_LIGHTNING_TRACEBACK", None)
    command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", QUICKSTART, "--sampler.group_sise=4"]
    result = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: unknown setting sampler.group_sise (gspo_lightning.sampling.sampler.GroupSampler); did you mean "
        "group_size?"
    ]


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    """Only mistakes in what the user wrote are shortened: an error of the code itself propagates."""
    from gspo_lightning.sampling import GroupSampler

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(GroupSampler, "on_train_batch_start", broken)
    monkeypatch.setattr(sys, "argv", ["gspo_lightning", "fit", "-c", QUICKSTART, TINY_POLICY, "--trainer.max_steps=1",
                                      "--trainer.enable_progress_bar=false"])  # fmt: skip
    with pytest.raises(ZeroDivisionError, match="a bug"):
        command_line()


@pytest.mark.parametrize("written", ["missing.yaml", "configs/../missing.yaml"])
def test_a_config_file_that_does_not_exist_is_named_as_written(written, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    monkeypatch.setattr(sys, "argv", ["gspo_lightning", "fit", "-c", QUICKSTART, "--config", written])
    with pytest.raises(SystemExit) as exit_:
        command_line()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: config file '{written}' does not exist"]


def test_a_setting_is_found_where_the_user_wrote_it(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("sampler:\n  rewards:\n    - class_path: my.Reward\n  episodes:\n    tools: [my.tool]\n")
    args = ["fit", "-c", str(config), "--model.init_args.policy.class_path=my.Policy", "--sampler.engine", "hf"]
    assert setting_holding("my.Reward", args) == "sampler.rewards[0]"
    assert setting_holding("my.tool", args) == "sampler.episodes.tools[0]"
    assert setting_holding("my.Policy", args) == "model.init_args.policy"
    assert setting_holding("hf", args) == "sampler.engine"
    assert setting_holding("elsewhere.Thing", args) is None
    # a later source overrides an earlier one: the setting that applies is named
    assert setting_holding("my.Reward", [*args, "--sampler.rewards=[my.Reward]"]) == "sampler.rewards[0]"
    assert setting_holding("my.Reward", [*args, "--data.init_args.source.class_path=my.Reward"]) == (
        "data.init_args.source"
    )
