"""Multi-turn episodes: tools, environments, and the generator every trajectory comes from (``loop.py``), which
``rollout/trajectories.py`` turns into a ``Rollout``. The modules: ``docs/architecture.md``; the guide:
``docs/episodes.md``.
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
