import pytest

from gspo_lightning.episodes import Step, ToolEnvironment, ToolError, calculator
from tests.episodes.scripted import calculator_call


def flaky(x: int) -> int:
    """Fails.

    Args:
        x: anything.
    """
    raise OSError("the service is down")


def test_the_prompt_is_the_first_message():
    env = ToolEnvironment([calculator])
    assert env.reset({"prompt": "2+2", "answer": "4"}) == [{"role": "user", "content": "2+2"}]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"}]
    assert env.reset({"prompt": chat}) == chat
    assert env.tools[0]["function"]["name"] == "calculator"


def test_an_answer_without_a_call_ends_the_episode():
    assert ToolEnvironment([calculator]).step("4") == Step(done=True)


def test_each_call_gets_its_result_as_a_tool_message():
    step = ToolEnvironment([calculator]).step(calculator_call("6*7") + calculator_call("1+1"))
    assert step.observation == [{"role": "tool", "name": "calculator", "content": "42"},
                                {"role": "tool", "name": "calculator", "content": "2"}]  # fmt: skip
    assert (step.done, step.tool_calls, step.tool_errors) == (False, 2, 0)


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"</tool_call>', "error: the tool call is not valid JSON"),
        ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "error: unknown tool 'search'; the tools are ['calculator']"),
        ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>', "error: calculator: missing a required argument"),
    ],
)  # fmt: skip
def test_the_models_mistakes_come_back_as_the_tools_result_and_are_counted(turn, message):
    step = ToolEnvironment([calculator]).step(turn)
    assert step.observation[0]["content"].startswith(message)
    assert (step.done, step.tool_calls, step.tool_errors) == (False, 1, 1)


def test_a_tool_that_raises_is_a_tool_error_naming_the_tool_and_the_call():
    with pytest.raises(ToolError, match=r"tool 'flaky' failed on the call .*\"x\": 1.*OSError: the service is down"):
        ToolEnvironment([flaky]).step('<tool_call>{"name": "flaky", "arguments": {"x": 1}}</tool_call>')


def test_a_tool_over_its_time_limit_is_a_tool_error():
    import threading

    gate = threading.Event()

    def stuck(x: int) -> int:
        """Hangs.

        Args:
            x: anything.
        """
        gate.wait(5)
        return x

    with pytest.raises(ToolError, match="tool 'stuck' .*ToolTimeoutError: did not return within 0.1 s"):
        ToolEnvironment([stuck], timeout_s=0.1).step('<tool_call>{"name": "stuck", "arguments": {"x": 1}}</tool_call>')
    gate.set()


def test_a_gymnasium_environment_runs_as_an_episode():
    import gymnasium

    from gspo_lightning.episodes import GymnasiumEnvironment

    gymnasium.register(id="tests/HigherLower-v0", entry_point="tests.episodes.envs:HigherLower")
    env = GymnasiumEnvironment("tests/HigherLower-v0", {"high": 7}, seed_column="seed")
    assert env.reset({"seed": 3, "prompt": ""}) == [{"role": "user", "content": "guess 0-7"}]
    again = GymnasiumEnvironment("tests/HigherLower-v0", {"high": 7}, seed_column="seed")
    again.reset({"seed": 3})
    assert env.env.unwrapped.hidden == again.env.unwrapped.hidden  # seeded from the row: reproducible
    step = env.step("eight")
    assert step.observation[0]["content"] == "error: answer with one integer from 0 to 7" and not step.done
    hidden = env.env.unwrapped.hidden
    wrong = (hidden + 1) % 8
    step = env.step(str(wrong))
    assert step.observation[0]["content"] == ("higher" if wrong < hidden else "lower") and step.reward == -0.1
    assert env.step(str(hidden)) == Step(observation=None, reward=1.0, done=True)
