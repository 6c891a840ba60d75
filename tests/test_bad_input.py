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
