"""sampler.episodes: every limit and contradiction refused early, naming the setting."""

import pytest

from gspo_lightning.episodes import EpisodeSettings, HermesToolCallParser, calculator
from gspo_lightning.engines import HFEngine
from gspo_lightning.module import GSPOModule
from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.rollout import checks
from gspo_lightning.sampling.sampler import GroupSampler
from gspo_lightning.validation import SettingError
from tests.episodes.envs import Counting
from tests.episodes.scripted import tool_loader


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "sampler.episodes needs exactly one of tools .* or environment .*; got neither"),
        ({"tools": [calculator], "environment": Counting}, "got both"),
        ({"tools": [calculator], "max_turns": 0}, "sampler.episodes.max_turns must be an integer >= 1, got 0"),
        ({"tools": [calculator], "max_turns": 1.5}, "max_turns must be an integer >= 1, got 1.5"),
        ({"tools": [calculator], "max_episode_tokens": 1}, "max_episode_tokens must be an integer >= 2 or null"),
        ({"tools": [calculator], "tool_timeout_s": 0}, "sampler.episodes.tool_timeout_s must be > 0 or null, got 0"),
        ({"tools": [calculator], "tool_parser": "xml"}, r"sampler.episodes.tool_parser must be one of \['hermes'\]"),
        ({"tools": [lambda x: x]}, "sampler.episodes.tools: tool .*lambda.*: its JSON schema cannot be built"),
    ],
)
def test_bad_settings_are_refused_naming_them(settings, message):
    with pytest.raises(SettingError, match=message):
        EpisodeSettings(**settings)


def test_the_parser_is_resolved_and_a_custom_one_kept():
    assert isinstance(EpisodeSettings(tools=[calculator]).tool_parser, HermesToolCallParser)
    custom = HermesToolCallParser("[[", "]]")
    assert EpisodeSettings(tools=[calculator], tool_parser=custom).tool_parser is custom


def test_the_episode_budget_must_fit_the_context():
    assert EpisodeSettings(tools=[calculator]).episode_budget(512) == 512
    assert EpisodeSettings(tools=[calculator], max_episode_tokens=100).episode_budget(512) == 100
    with pytest.raises(SettingError, match="max_episode_tokens=600 exceeds the policy's context length 512"):
        EpisodeSettings(tools=[calculator], max_episode_tokens=600).episode_budget(512)


def test_contradicting_sampler_settings_are_refused():
    episodes = EpisodeSettings(tools=[calculator])
    with pytest.raises(SettingError, match="sampler.prompt_overflow='truncate' applies to single responses"):
        GroupSampler(rewards=[ExactAnswer()], episodes=episodes, prompt_overflow="truncate")
    with pytest.raises(SettingError, match="tensor_parallel_size > 1 is not supported"):
        checks.validate_episodes(episodes, "error", type("TP", (), {"tensor_parallel_size": 2})())
    checks.validate_episodes(episodes, "error", HFEngine())


def test_per_turn_advantages_need_an_objective_with_per_token_advantages():
    episodes = EpisodeSettings(tools=[calculator], turn_advantages=True)
    with pytest.raises(SettingError, match=r"objective \(model.init_args.objective\) takes one advantage per "
                                           "response: use an objective with per-token advantages"):  # fmt: skip
        checks.check_turn_advantages(episodes, GSPOModule(tool_loader(), objective="gspo").per_token_advantages)
    checks.check_turn_advantages(episodes, GSPOModule(tool_loader(), objective="gspo_token").per_token_advantages)


def test_episodes_need_a_chat_template():
    with pytest.raises(SettingError, match="the policy's tokenizer has none"):
        checks.check_episode_tokenizer(tool_loader(chat_template=None).load_tokenizer())
