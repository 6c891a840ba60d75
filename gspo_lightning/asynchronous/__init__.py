"""Asynchronous rollouts: sampling runs ahead of training by a bounded number of policy versions (the modules:
``docs/architecture.md``; the modes: ``docs/asynchronous.md``).

A policy version is the number of rollout rounds trained so far: the trainer's weights at the start of round r
are version r. The round's own stages after sampling (pi_old's pass with the current weights, the proximal policy;
advantages; the K minibatches) are ``rollout/round.py``'s, unchanged.
"""

from gspo_lightning.asynchronous.settings import ASYNC_MODES, AsyncMode, AsyncRollouts

__all__ = ["ASYNC_MODES", "AsyncMode", "AsyncRollouts"]
