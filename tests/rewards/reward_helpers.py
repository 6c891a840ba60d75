"""Module-level reward functions for the isolation tests: a worker process must be able to import them.

Kept free of heavy imports so that a spawned worker starts in a fraction of a second.
"""

from __future__ import annotations

import os
import time


def constant_reward(prompts, completions, **columns) -> list[float]:
    return [1.0 for _ in completions]


def exiting_reward(prompts, completions, **columns) -> list[float]:
    os._exit(1)  # what a segfault or a C extension calling exit() looks like from outside


def hanging_reward(prompts, completions, **columns) -> list[float]:
    time.sleep(30)
    return [0.0 for _ in completions]


def worker_pid_reward(prompts, completions, **columns) -> list[float]:
    return [float(os.getpid()) for _ in completions]
