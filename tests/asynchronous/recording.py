"""Engines that write down, for every sampling call, its seed and the step of the weights it sampled with."""

from __future__ import annotations

import json
import os
import time

import lightning.pytorch as pl

from gspo_lightning import GroupSampler
from gspo_lightning.engines import HFEngine, VLLMProcessEngine


def _record(seed: int, step: int, group_size: int) -> None:
    with open(os.environ["GSPO_TEST_RECORD"], "a") as handle:
        handle.write(json.dumps({"seed": seed, "step": step, "group_size": group_size}) + "\n")


class RecordingHFEngine(HFEngine):
    """``generate`` on the live policy: the weights are the trainer's at the last ``before_rollout``."""

    def before_rollout(self, trainer, pl_module) -> None:
        super().before_rollout(trainer, pl_module)
        self._step = trainer.global_step

    def sample(self, policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, with_logprobs=False,
               synced_gpus=False, seed=0, with_routes=False):  # fmt: skip
        _record(seed, self._step, group_size)
        return super().sample(policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, with_logprobs,
                              synced_gpus, seed)  # fmt: skip


class RecordingVLLMProcessEngine(VLLMProcessEngine):
    """vLLM in its own process: the weights are the snapshot it has loaded."""

    def sample(self, policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, with_logprobs=False,
               synced_gpus=False, seed=0, with_routes=False):  # fmt: skip
        _record(seed, self.loaded.step, group_size)
        return super().sample(policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, with_logprobs,
                              synced_gpus, seed)  # fmt: skip


class SlowRecordingVLLMProcessEngine(RecordingVLLMProcessEngine):
    """Each sampling call also sleeps half a second (on the engine's thread): generation long enough to tell a
    trainer that waits for it from one that does not, whatever the machine's load."""

    def sample(self, *args, **kwargs):
        time.sleep(0.5)
        return super().sample(*args, **kwargs)


class RecordTrainedPrompts(pl.Callback):
    """After each round's first step: the round and the prompts it trained on (one per group), as JSON lines in
    ``$GSPO_TEST_TRAINED``."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch.minibatch_index != 0:
            return
        sampler = next(c for c in trainer.callbacks if isinstance(c, GroupSampler))
        rollout = sampler.last_rollout
        prompts = rollout.prompts[:: sampler.group_size]
        with open(os.environ["GSPO_TEST_TRAINED"], "a") as handle:
            handle.write(json.dumps({"round": batch.rollout_index, "prompts": prompts}) + "\n")
