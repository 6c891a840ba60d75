"""The episode loop and the rollout it makes, on a scripted engine whose every token is known."""

import math

import pytest
import torch

from gspo_lightning.episodes import Environment, EpisodeError, EpisodeSettings, Step, calculator, environment_reward
from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.rollout.pipeline import Scoring
from gspo_lightning.rollout.round import RoundModel, RoundSettings, run_round
from gspo_lightning.rollout.types import PromptBatch
from tests.episodes.scripted import ScriptedEngine, calculator_call, calculator_policy, tool_loader

QUESTIONS = [[{"role": "user", "content": "12*34"}], [{"role": "user", "content": "56+7"}]]
BATCH = PromptBatch(QUESTIONS, {"answer": ["408", "63"]})


@pytest.fixture(scope="module")
def parts():
    loader = tool_loader()
    tokenizer = loader.load_tokenizer()
    return loader.load_model(tokenizer).eval(), tokenizer


def one_round(parts, respond, episodes: EpisodeSettings, rewards=None, errors="raise", max_new_tokens=96, group=2):
    policy, tokenizer = parts
    engine = ScriptedEngine(respond)
    settings = RoundSettings(group_size=group, num_minibatches=1, episodes=episodes,
                             scoring=Scoring(rewards or [ExactAnswer()], [1.0] * len(rewards or [1]), errors=errors))  # fmt: skip
    model = RoundModel(policy, tokenizer, max_new_tokens=max_new_tokens, engine_logprobs=True)
    return run_round(engine, model, settings, BATCH, seed=0), engine, tokenizer


def test_a_tool_episode_trains_on_the_policys_tokens_only(parts):
    result, engine, tokenizer = one_round(parts, calculator_policy, EpisodeSettings(tools=[calculator]))
    rollout = result.rollout
    assert torch.equal(rollout.rewards, torch.ones(4)) and rollout.episodes.turns.tolist() == [2, 2, 2, 2]
    assert rollout.episodes.tool_calls.tolist() == [1, 1, 1, 1] and not rollout.truncated.any()
    # the second turn continued each episode's own ids: the tool's result, then the generation prompt
    assert engine.calls[1][0].endswith(calculator_call("12*34") + "<eos>T:408\nA:")
    for row, answer in enumerate(["408", "408", "63", "63"]):
        ids = rollout.response_ids[row][rollout.response_attention[row].bool()].tolist()
        policy = rollout.response_mask[row].bool()
        call = tokenizer(calculator_call(["12*34", "56+7"][row // 2]), add_special_tokens=False)["input_ids"]
        written = call + [tokenizer.eos_token_id] + tokenizer(answer, add_special_tokens=False)["input_ids"] + [1]
        assert rollout.response_ids[row][policy].tolist() == written
        between = tokenizer.decode([t for t, p in zip(ids, policy.tolist()) if not p])
        assert between == f"T:{answer}\nA:"  # the context tokens: the tool message and the next prompt
        turns = rollout.turn_index[row][rollout.response_attention[row].bool()].tolist()
        assert turns == [0] * (len(call) + 1) + [-1] * len(between) + [1] * (len(answer) + 1)
        # the engine's log-probs sit on the tokens it wrote, turn by turn; context positions hold 0
        first = -0.01 * (torch.arange(len(call) + 1) + 1) - 0.001 * row
        torch.testing.assert_close(rollout.engine_logprobs[row, : len(call) + 1], first)
        assert torch.all(rollout.engine_logprobs[row][~policy & rollout.response_attention[row].bool()] == 0)
    minibatch = result.minibatches[0]
    assert torch.equal(minibatch.attention_mask[:, -minibatch.response_ids.shape[1]:],
                       rollout.response_attention[:, : minibatch.response_ids.shape[1]])  # fmt: skip
    assert "T:408" in rollout.completions[0] and rollout.completions[0].count("<eos>") == 2


def test_finished_episodes_drop_out_of_the_batch(parts):
    def respond(context):  # prompt 0 answered at once, prompt 1 through the tool
        return "408" if "12*34" in context else calculator_policy(context)

    result, engine, _ = one_round(parts, respond, EpisodeSettings(tools=[calculator]))
    assert [len(call) for call in engine.calls] == [4, 2]
    assert result.rollout.episodes.turns.tolist() == [1, 1, 2, 2]
    assert result.rollout.episodes.tool_calls.tolist() == [0, 0, 1, 1]


def test_max_turns_truncates(parts):
    result, _, _ = one_round(parts, lambda c: calculator_call("1+1"), EpisodeSettings(tools=[calculator], max_turns=3))
    counts = result.rollout.episodes
    assert counts.turns.tolist() == [3] * 4 and counts.truncated_turns.all() and result.rollout.truncated.all()


def test_max_new_tokens_truncates_a_turn(parts):
    result, _, tokenizer = one_round(parts, lambda c: "4" * 20, EpisodeSettings(tools=[calculator]), max_new_tokens=8)
    counts, rollout = result.rollout.episodes, result.rollout
    assert counts.truncated_turn_tokens.all() and rollout.response_mask.sum(-1).tolist() == [8] * 4
    assert rollout.completions[0] == "4" * 8


def test_max_episode_tokens_cuts_the_last_turn_to_fit(parts):
    settings = EpisodeSettings(tools=[calculator], max_episode_tokens=90)
    result, _, _ = one_round(parts, calculator_policy, settings)
    rollout = result.rollout
    lengths = rollout.prompt_mask.sum(-1) + rollout.response_attention.sum(-1)
    assert lengths.max() <= 90 and rollout.episodes.truncated_context.all()
    with pytest.raises(EpisodeError, match="first messages take 28 tokens, leaving no room for a turn within the "
                                           "episode's 20 tokens"):  # fmt: skip
        one_round(parts, calculator_policy, EpisodeSettings(tools=[calculator], max_episode_tokens=20))


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: anything.
    """
    raise ConnectionError("no route")


def test_a_failing_tool_stops_the_run_naming_the_tool_the_call_and_the_episode(parts):
    respond = lambda c: '<tool_call>{"name": "broken", "arguments": {"x": 3}}</tool_call>'  # noqa: E731
    with pytest.raises(EpisodeError, match=r"episode 0 \(ToolEnvironment, turn 0\): ToolError: tool 'broken' failed on "
                                           r"the call .*\"x\": 3.*ConnectionError: no route"):  # fmt: skip
        one_round(parts, respond, EpisodeSettings(tools=[broken]))


def test_under_skip_a_failing_tool_leaves_its_group_out(parts):
    def respond(context):
        if "12*34" in context:
            return '<tool_call>{"name": "broken", "arguments": {"x": 3}}</tool_call>'
        return calculator_policy(context)

    result, _, _ = one_round(parts, respond, EpisodeSettings(tools=[calculator, broken]), errors="skip")
    rollout = result.rollout
    assert rollout.rewards[:2].isnan().all() and torch.equal(rollout.rewards[2:], torch.ones(2))
    assert rollout.episodes.failed.tolist() == [True, True, False, False]
    assert torch.equal(rollout.advantages, torch.zeros(4))


class GuessNumber(Environment):
    """Guess a hidden number in [1, 8]: "higher" / "lower" after each wrong guess, reward 1 for the right one,
    -0.1 for each wrong one."""

    def reset(self, row):
        self.hidden = int(row["answer"]) % 8 + 1
        return [{"role": "user", "content": "guess 1-8"}]

    def step(self, turn):
        guess = int(turn) if turn.strip().isdigit() else 0
        if guess == self.hidden:
            return Step(reward=1.0, done=True)
        return Step(observation=[{"role": "user", "content": "higher" if guess < self.hidden else "lower"}], reward=-0.1)


def binary_search(context):
    """Halves the range after each reply: the context is "U:guess 1-8\nA:4<eos>U:lower\nA:..."."""
    low, high = 1, 8
    for part in context.split("A:")[1:-1]:  # each earlier turn: "<guess><eos>U:<reply>\n"
        guess, reply = part.split("<eos>U:")
        low, high = (int(guess) + 1, high) if reply.strip() == "higher" else (low, int(guess) - 1)
    return str((low + high) // 2)


def test_a_users_environment_class_with_its_own_rewards(parts):
    settings = EpisodeSettings(environment=GuessNumber, max_turns=4, turn_advantages=True)
    result, _, _ = one_round(parts, binary_search, settings, rewards=[environment_reward])
    rollout = result.rollout
    turns = rollout.episodes.turns.tolist()
    assert turns == [3, 3, 4, 4]  # hidden 1: guesses 4, 2, 1; hidden 8: 4, 6, 7, 8
    assert all(math.isclose(r, 1.0 - 0.1 * (t - 1), abs_tol=1e-6) for r, t in zip(rollout.rewards.tolist(), turns))
    # per-turn: a turn is credited with what follows it only
    token = rollout.token_advantages
    assert token is not None and token.shape == rollout.response_ids.shape
    assert torch.all(token[~rollout.response_mask.bool()] == 0)
    assert torch.equal(result.minibatches[0].advantages, token[:, : result.minibatches[0].response_ids.shape[1]])


def test_an_environment_that_forgets_its_observation_is_named(parts):
    class Mute(GuessNumber):
        def step(self, turn):
            return Step(reward=0.0)

    with pytest.raises(EpisodeError, match=r"episode 0: Mute.step returned no observation for an episode that is not "
                                           r"done"):  # fmt: skip
        one_round(parts, binary_search, EpisodeSettings(environment=Mute), rewards=[environment_reward])


def test_dynamic_sampling_refills_episode_groups(parts):
    """Episode rollouts of different widths join and select like single responses, counts and turn data along."""
    policy, tokenizer = parts
    calls = {"n": 0}

    def respond(context):  # the first batch answers at once (all wrong), later ones use the tool
        return calculator_policy(context) if calls["n"] else "0"

    engine = ScriptedEngine(respond)
    settings = RoundSettings(group_size=2, num_minibatches=1, scoring=Scoring([ExactAnswer()], [1.0]),
                             episodes=EpisodeSettings(tools=[calculator]), dynamic_sampling=True, max_extra_draws=1)  # fmt: skip

    def draw():
        calls["n"] += 1
        return PromptBatch([QUESTIONS[1], QUESTIONS[0]], {"answer": ["63", "999"]})

    model = RoundModel(policy, tokenizer, max_new_tokens=96)
    result = run_round(engine, model, settings, BATCH, seed=0, draw_prompts=draw)
    rollout = result.rollout
    assert result.counts == {"groups_drawn": 4, "groups_dropped": 4, "groups_kept": 0, "extra_draws": 1}
    assert len(rollout) == 4 and len(rollout.episodes.turns) == 4
    assert rollout.turn_index.shape == rollout.response_ids.shape == rollout.response_attention.shape
    assert torch.all(rollout.turn_index[rollout.response_attention == 0] == -1)


def test_the_docs_environment_runs_as_written(parts):
    """The ``GuessNumber`` example of ``docs/episodes.md``, executed from the page itself, in a round."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "episodes.md").read_text()
    section = readme.split("# Multi-turn episodes", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/episodes.md", "exec"), namespace)  # noqa: S102 - the project's own docs
    policy, tokenizer = parts

    def search(context):  # "U:Guess my number, 1 to 8.\nA:4<eos>U:lower\nA:..."
        low, high = 1, 8
        for part in context.split("A:")[1:-1]:
            guess, reply = part.split("<eos>U:")
            low, high = (int(guess) + 1, high) if reply.strip() == "higher" else (low, int(guess) - 1)
        return str((low + high) // 2)

    settings = RoundSettings(group_size=2, num_minibatches=1, scoring=Scoring([environment_reward], [1.0]),
                             episodes=EpisodeSettings(environment=namespace["GuessNumber"], max_turns=4))  # fmt: skip
    batch = PromptBatch(["unused", "unused"], {"answer": ["3", "8"]})
    result = run_round(ScriptedEngine(search), RoundModel(policy, tokenizer, max_new_tokens=8), settings, batch, 0)
    assert result.rollout.episodes.turns.tolist() == [3, 3, 4, 4]  # 3: guesses 4, 2, 3; 8: 4, 6, 7, 8
    assert torch.allclose(result.rollout.rewards, torch.tensor([0.8, 0.8, 0.7, 0.7]))
