"""Engines that write down, for every sampling call, its seed and the step of the weights it sampled with."""

from __future__ import annotations

import json
import os

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
               synced_gpus=False, seed=0):  # fmt: skip
        _record(seed, self._step, group_size)
        return super().sample(policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, with_logprobs,
                              synced_gpus, seed)  # fmt: skip


class RecordingVLLMProcessEngine(VLLMProcessEngine):
    """vLLM in its own process: the weights are the snapshot it has loaded."""

    def sample(self, policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, with_logprobs=False,
               synced_gpus=False, seed=0):  # fmt: skip
        _record(seed, self.loaded.step, group_size)
        return super().sample(policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, with_logprobs,
                              synced_gpus, seed)  # fmt: skip
