"""Asynchronous rollouts: sampling runs ahead of training by a bounded number of policy versions.

    settings.py    ``sampler.asynchronous``: the mode and its bound
    schedule.py    which weights sample which round (pure functions of the round index)
    producer.py    where the sampling of a round runs: in line, or on a background thread beside training
    rounds.py      a round under each mode: submit what is due, take this round's samples, train on them
    streaming.py   the streaming loop: chunks, new weights between them, admission control
    checkpoint.py  sampled rounds not yet trained, as plain data for the checkpoint
    metrics.py     policy-version lag of tokens and sequences

A policy version is the number of rollout rounds trained so far: the trainer's weights at the start of round r
are version r. The round's own stages after sampling (pi_old's pass with the current weights, the proximal policy;
advantages; the K minibatches) are ``rollout/round.py``'s, unchanged.
"""

from gspo_lightning.asynchronous.settings import ASYNC_MODES, AsyncMode, AsyncRollouts

__all__ = ["ASYNC_MODES", "AsyncMode", "AsyncRollouts"]
