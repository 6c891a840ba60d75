"""What an episodes run needs and is told when it lacks it: the held-out evaluation of an environment's episodes
scores them with the environment's reward unless told otherwise, and a policy without a chat template is told
which built-in policies have one and how to give one."""

from __future__ import annotations

import pytest

from gspo_lightning.episodes import EpisodeSettings, calculator, environment_reward
from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.rollout import checks
from gspo_lightning.rollout.data_contract import DataSide
from gspo_lightning.sampling.evaluation import HeldOutEvaluation, default_correct
from gspo_lightning.validation import SettingError
from tests.episodes.envs import Counting
from tests.episodes.scripted import tool_loader


def test_an_environments_episodes_are_scored_by_the_environments_reward_unless_told_otherwise():
    episodes = EpisodeSettings(environment=Counting)
    assert default_correct(episodes) is environment_reward
    assert HeldOutEvaluation().correct is None  # the setting may be left out
    chosen = ExactAnswer()
    assert HeldOutEvaluation(correct=chosen).correct is chosen


@pytest.mark.parametrize(
    ("episodes", "scored"),
    [(None, "each held-out completion"), (EpisodeSettings(tools=[calculator]), "the final answer of each episode")],
)
def test_without_an_environment_evaluation_correct_is_required_naming_what_to_set(episodes, scored):
    with pytest.raises(SettingError) as raised:
        default_correct(episodes)
    assert str(raised.value) == (
        f"evaluation.correct is not set: name the reward function that scores {scored} (a completion counts as "
        "solved when its score reaches evaluation.solved_at), e.g. evaluation.correct: {class_path: "
        "gspo_lightning.rewards.ExactAnswer}; only episodes with an environment (sampler.episodes.environment) "
        "default to their environment's reward, gspo_lightning.episodes.environment_reward"
    )


def _has_template(policy) -> bool:
    return bool(policy.load_tokenizer().chat_template)


def test_the_policies_the_chat_template_message_names_do_have_one():
    from gspo_lightning.data import CalculatorWarmStartedTinyQwen3, WarmStartedTinyQwen3
    from gspo_lightning.models import TinyQwen3

    message = checks.chat_template_help("tools")
    assert "gspo_lightning.data.CalculatorWarmStartedTinyQwen3 has the tools one" in message
    assert "model.init_args.policy.init_args.base: {class_path: gspo_lightning.models.TinyQwen3, init_args: " \
           "{chat_template: tools}}" in message  # fmt: skip
    assert _has_template(TinyQwen3(chat_template="tools")) and not _has_template(TinyQwen3())
    assert CalculatorWarmStartedTinyQwen3().base.chat_template is not None  # its tokenizer is its base's
    assert WarmStartedTinyQwen3(base=TinyQwen3(chat_template="tools")).base.chat_template is not None
    assert WarmStartedTinyQwen3().base.chat_template is None  # the quick start's: none


def test_episodes_without_a_chat_template_name_the_policy_and_how_to_give_one():
    loader = tool_loader(chat_template=None)
    with pytest.raises(SettingError) as raised:
        checks.check_episode_tokenizer(loader.load_tokenizer(), loader)
    assert str(raised.value) == (
        "sampler.episodes renders the conversation with the tokenizer's chat template, but the policy's tokenizer "
        "(gspo_lightning.models.loaders.TinyQwen3) has none: give the policy one: "
        + checks.chat_template_help("tools")
    )


def test_chat_prompts_without_a_chat_template_say_how_to_do_without_or_give_one():
    class ChatData:
        class formatter:  # noqa: N801 - stands in for the data module's formatter
            chat = True

    with pytest.raises(SettingError) as raised:
        checks.check_chat_template(DataSide(ChatData()), tool_loader(chat_template=None).load_tokenizer())
    assert str(raised.value) == (
        "the data module builds chat prompts (data.init_args.chat_template: true) but the policy's tokenizer has no "
        "chat template: set data.init_args.chat_template: false (and put the instruction into "
        "data.init_args.prompt_template), or give the policy one: " + checks.chat_template_help("simple")
    )


@pytest.mark.slow
def test_an_environment_run_without_evaluation_correct_evaluates_with_the_environments_reward(tmp_path):
    import csv

    import yaml

    from tests.episodes.test_cli_episodes import _run, episode_config

    config = episode_config(tmp_path, steps=4)
    written = yaml.safe_load(config.read_text())
    del written["evaluation"]["correct"]
    config.write_text(yaml.safe_dump(written))
    result = _run(config)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "runs/tiny/version_0/metrics.csv").open()))
    accuracy = [float(row["eval/accuracy"]) for row in rows if row["eval/accuracy"]]
    assert len(accuracy) == 2 and all(0.0 <= value <= 1.0 for value in accuracy)  # at step 0 and step 4
