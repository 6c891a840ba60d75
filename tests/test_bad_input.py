"""Bad settings fail early, through the real CLI, before any model is loaded, naming the setting and the values."""

from __future__ import annotations

import pytest

from gspo_lightning.cli import main
from tests.test_cli import ROOT

QUICKSTART = str(ROOT / "configs/quickstart.yaml")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--sampler.group_size=1", "sampler.group_size must be >= 2"),
        ("--model.init_args.eps_low=0", r"model.eps_low must be in \(0, 1\), got 0"),
        ("--model.init_args.eps_high=1.5", r"model.eps_high must be in \(0, 1\), got 1.5"),
        ("--sampler.num_minibatches=3", "num_minibatches=3 must be >= 1 and divide the rollout batch of 128"),
        ("--sampler.max_new_tokens=0", "sampler.max_new_tokens must be >= 1, got 0"),
        ("--model.init_args.objective=ppo", "unknown objective 'ppo'; allowed names: dapo, dr_grpo, grpo, gspo"),
        ('--model.init_args.objective={"ratio": "sequence", "aggregation": "token_mean"}', "by its length"),
        ("--data.init_args.prompts_per_rollout=0", "data.prompts_per_rollout must be a positive integer"),
    ],
)
def test_bad_setting_fails_while_the_config_is_instantiated(override, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        main(["-c", QUICKSTART, override], run=False)


def test_a_template_column_the_data_set_lacks_fails_at_setup_before_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = main(["-c", QUICKSTART, "--data.init_args.prompt_template={problem}="], run=False)
    assert cli.model.policy is None  # the model is built in configure_model, after data setup
    with pytest.raises(ValueError, match=r"problem"):
        cli.datamodule.setup("fit")


CODE_SAMPLE = ROOT / "configs/code_sample.yaml"


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("memory_mb", 16, r"CodeTests.memory_mb must be >= 64 \(a Python interpreter needs it\), got 16"),
        ("disk_mb", 0, "CodeTests.disk_mb must be a positive number, got 0"),
        ("max_files", -1, "CodeTests.max_files must be a positive number, got -1"),
        ("max_workers", 0, r"CodeTests.max_workers must be >= 1 \(or None for the CPU count\), got 0"),
    ],
)
def test_a_bad_sandbox_setting_of_the_code_reward_is_named(setting, value, message, tmp_path, monkeypatch):
    import yaml

    config = yaml.safe_load(CODE_SAMPLE.read_text())
    config["sampler"]["rewards"][0]["init_args"][setting] = value
    path = tmp_path / "code.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        main(["-c", str(path)], run=False)
