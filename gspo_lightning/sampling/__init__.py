"""The Lightning callbacks that sample: ``GroupSampler`` (the training rounds) and ``HeldOutEvaluation``.

They sit above the round's core (``rollout/``) and the asynchronous round sources (``asynchronous/``): the sampler
picks a ``rollout/source.py`` ``RoundSource`` for ``sampler.asynchronous.mode`` and hands it each round.
"""

from gspo_lightning.sampling.evaluation import HeldOutEvaluation
from gspo_lightning.sampling.sampler import GroupSampler

__all__ = ["GroupSampler", "HeldOutEvaluation"]
