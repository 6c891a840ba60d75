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
