"""Environments as a user writes them, outside the package, named in configs by ``class_path``."""

from __future__ import annotations

from gspo_lightning.episodes import Environment, Step

COUNTING_ALPHABET = "0123456789ASTU:\n"
"""Enough characters for ``Counting``'s messages in the compact tool template, and few enough that a random tiny
model ends a turn (EOS) within a few tokens."""


class Counting(Environment):
    """Answers every turn with the number of characters the turn had; done after ``turns`` turns. The reward of a
    turn is its length over 10, so a random policy gets a varied learning signal over several turns."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns
        self.taken = 0

    def reset(self, row):
        return [{"role": "user", "content": str(row["answer"])[:2]}]

    def step(self, turn):
        self.taken += 1
        reward = len(turn) / 10
        if self.taken >= self.turns:
            return Step(reward=reward, done=True)
        return Step(observation=[{"role": "user", "content": str(len(turn) % 10)}], reward=reward)


class HigherLower:
    """A Gymnasium environment with text observations: guess a number in [0, 7] from "higher" / "lower"."""

    def __new__(cls, *args, **kwargs):
        import gymnasium

        class _HigherLower(gymnasium.Env):
            def __init__(self, high: int = 7) -> None:
                self.high = high
                self.observation_space = gymnasium.spaces.Text(16, charset="abcdefghijklmnopqrstuvwxyz0123456789 -")
                self.action_space = gymnasium.spaces.Discrete(high + 1)

            def reset(self, seed=None, options=None):
                super().reset(seed=seed)
                self.hidden = int(self.np_random.integers(0, self.high + 1))
                return f"guess 0-{self.high}", {}

            def step(self, action):
                if action == self.hidden:
                    return "right", 1.0, True, False, {}
                return ("higher" if action < self.hidden else "lower"), -0.1, False, False, {}

        return _HigherLower(*args, **kwargs)
