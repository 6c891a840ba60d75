"""A Gymnasium environment as an episode's environment: text observations in, the policy's turn as the action.

Why Gymnasium: it is the environment interface most RL code already speaks (``reset`` / ``step`` with
``terminated`` / ``truncated``), it installs from the registry with light dependencies, and it has text spaces
(``gymnasium.spaces.Text``). OpenEnv environments are HTTP servers in containers, and ``verifiers`` drives its own
OpenAI-client rollouts: neither fits an engine that the trainer drives turn by turn.
"""

from __future__ import annotations

from typing import Any

from gspo_lightning.episodes.environment import Environment, Message, Step

INSTALL_HINT = "pip install 'gspo-lightning[gym]' (gymnasium)"


class GymnasiumEnvironment(Environment):
    """``gymnasium.make(env_id, **make_kwargs)``, one per episode, observations shown as user messages.

    The action is the turn's text when the action space is ``Text``, its integer for a ``Discrete`` space (a
    turn that is not one gets an error message as the observation, and the environment is not stepped);
    ``terminated`` or ``truncated`` end the episode, and the step's reward is the turn's.

    Args:
        env_id: a registered Gymnasium id (its module imported first when given as ``module:EnvId``).
        make_kwargs: keyword arguments of ``gymnasium.make``.
        seed_column: the data column seeding ``reset`` (None: unseeded; the env's own randomness is then not
            reproduced on resume).
        options_column: a data column passed as ``reset``'s ``options`` (None: none).
    """

    def __init__(
        self,
        env_id: str,
        make_kwargs: dict[str, Any] | None = None,
        seed_column: str | None = None,
        options_column: str | None = None,
    ) -> None:
        try:
            import gymnasium
        except ImportError as error:
            raise ImportError(f"GymnasiumEnvironment needs gymnasium: {INSTALL_HINT}") from error
        self.env = gymnasium.make(env_id, **(make_kwargs or {}))
        self.seed_column, self.options_column = seed_column, options_column
        self._discrete = isinstance(self.env.action_space, gymnasium.spaces.Discrete)

    def reset(self, row: dict[str, Any]) -> list[Message]:
        seed = None if self.seed_column is None else int(row[self.seed_column])
        options = None if self.options_column is None else row[self.options_column]
        observation, _ = self.env.reset(seed=seed, options=options)
        return [{"role": "user", "content": str(observation)}]

    def step(self, turn: str) -> Step:
        action: Any = turn
        if self._discrete:
            text = turn.strip()
            if not text.lstrip("-").isdigit() or not self.env.action_space.contains(int(text)):
                choices = f"{self.env.action_space.start} to {self.env.action_space.start + self.env.action_space.n - 1}"
                return Step(observation=[{"role": "user", "content": f"error: answer with one integer from {choices}"}])
            action = int(text)
        observation, reward, terminated, truncated, _ = self.env.step(action)
        done = bool(terminated or truncated)
        return Step(observation=None if done else [{"role": "user", "content": str(observation)}],
                    reward=float(reward), done=done)  # fmt: skip
