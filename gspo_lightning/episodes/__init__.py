"""Multi-turn episodes: tools, environments, and the loop that rolls them out turn by turn.

    settings.py     sampler.episodes: tools or an environment, the limits
    environment.py  Environment (reset / step), Step, ToolEnvironment (the tool-calling loop)
    gymnasium_adapter.py  a Gymnasium environment (text observations) as an Environment
    parsers.py      reading tool calls from a turn (Hermes / Qwen3 <tool_call> JSON)
    tools.py        tools from typed Python functions; calculator, RunPython (the sandbox)
    rendering.py    token in, token out: the template's tokens between turns
    loop.py         all episodes advance together, turn by turn, on the engine
    rewards.py      what reward functions see of an episode (environment_reward)

``gspo_lightning.rollout.trajectories`` turns finished episodes into a ``Rollout``.
"""

from gspo_lightning.episodes.environment import Environment, Message, Step, ToolEnvironment, ToolError
from gspo_lightning.episodes.gymnasium_adapter import GymnasiumEnvironment
from gspo_lightning.episodes.loop import EpisodeCodeError, EpisodeError, EpisodeState
from gspo_lightning.episodes.parsers import HermesToolCallParser, ToolCall, ToolCallParser
from gspo_lightning.episodes.rewards import environment_reward
from gspo_lightning.episodes.settings import EpisodeSettings
from gspo_lightning.episodes.tools import RunPython, Tool, calculator

__all__ = [
    "Environment", "EpisodeCodeError", "EpisodeError", "EpisodeSettings", "EpisodeState", "GymnasiumEnvironment",
    "HermesToolCallParser", "Message", "RunPython", "Step", "Tool", "ToolCall", "ToolCallParser", "ToolEnvironment",
    "ToolError", "calculator", "environment_reward",
]  # fmt: skip
