"""vLLM's KV cache sized from what a round holds: the bytes (hand-computed), the engine arguments, and the need the
sampler and the evaluation reserve before the engine is built."""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch

from gspo_lightning import GroupSampler, GSPOModule
from gspo_lightning import HeldOutEvaluation
from gspo_lightning.data import ArithmeticTask, PromptDataModule
from gspo_lightning.engines.base import RoundNeed
from gspo_lightning.engines.hf import HFEngine
from gspo_lightning.models import TinyQwen3
from gspo_lightning.rewards import ExactAnswer
from tests.conftest import TINY
from tests.fault_helpers import length_reward

CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
          "max_position_embeddings": 2048}  # fmt: skip
PER_TOKEN = 2 * 2 * 2 * 64 * 4  # keys and values x layers x KV heads x head size (256 / 4) x float32 bytes


def test_a_round_takes_each_sequence_at_its_longest_in_blocks_and_a_block_more():
    from gspo_lightning.engines.vllm_options import kv_cache_bytes

    # 64 sequences of up to 300 tokens: ceil(300 / 128) = 3 blocks, +1 each = 256 blocks of 128 tokens
    assert kv_cache_bytes(CONFIG, "float32", RoundNeed(64, 300), 2048) == 256 * 128 * PER_TOKEN  # 64 MiB
    assert kv_cache_bytes(CONFIG, "bfloat16", RoundNeed(64, 300), 2048) == 256 * 128 * PER_TOKEN // 2
    # a sequence never needs more than the context; and one context-long sequence (16 blocks) is the least
    assert kv_cache_bytes(CONFIG, "float32", RoundNeed(2, 10_000), 2048) == 2 * 17 * 128 * PER_TOKEN
    assert kv_cache_bytes(CONFIG, "float32", RoundNeed(1, 10), 2048) == 16 * 128 * PER_TOKEN
    with_head_dim = dict(CONFIG, head_dim=128)  # Qwen3 states its head size apart from the width
    assert kv_cache_bytes(with_head_dim, "float32", RoundNeed(1, 10), 2048) == 2 * 16 * 128 * PER_TOKEN


def test_the_engine_arguments_carry_the_size_asked_for_else_the_rounds_else_one_gib():
    pytest.importorskip("vllm")
    from gspo_lightning.engines.vllm_options import VLLMOptions, kv_cache_bytes

    cpu = torch.device("cpu")
    sized = VLLMOptions().llm_arguments("/m", "float32", cpu, CONFIG, RoundNeed(64, 300))
    assert sized["kv_cache_memory_bytes"] == kv_cache_bytes(CONFIG, "float32", RoundNeed(64, 300), 2048)
    assert sized["max_num_seqs"] == 64
    assert VLLMOptions().llm_arguments("/m", "float32", cpu, CONFIG, RoundNeed(1024, 8))["max_num_seqs"] == 256
    told = VLLMOptions(kv_cache_gib=0.5).llm_arguments("/m", "float32", cpu, CONFIG, RoundNeed(64, 300))
    assert told["kv_cache_memory_bytes"] == 2**29 and "max_num_seqs" not in told
    assert VLLMOptions().llm_arguments("/m", "float32", cpu, CONFIG)["kv_cache_memory_bytes"] == 2**30


def test_a_round_larger_than_memory_allows_gets_the_budget_and_a_warning(monkeypatch):
    pytest.importorskip("vllm")
    from gspo_lightning.engines import vllm_options

    monkeypatch.setattr(vllm_options, "kv_budget", lambda device, utilization: 2**20)
    with pytest.warns(UserWarning, match=r"a round needs 0.1 GiB of KV cache, more than .* \(0.0 GiB\): .* waves"):
        arguments = vllm_options.VLLMOptions().llm_arguments("/m", "float32", torch.device("cpu"), CONFIG,
                                                             RoundNeed(64, 300))  # fmt: skip
    assert arguments["kv_cache_memory_bytes"] == 2**20


class ReservedAtSetup(HFEngine):
    """``generate``, recording the need reserved when it is set up."""

    def setup(self, trainer, pl_module):
        self.at_setup = self.need
        super().setup(trainer, pl_module)


@pytest.mark.parametrize("evaluation_first", [True, False])
def test_the_sampler_and_the_evaluation_reserve_their_rounds_before_the_engine_is_built(tmp_path, evaluation_first):
    torch.manual_seed(0)
    module = GSPOModule(TinyQwen3(**TINY, max_position_embeddings=64),
                        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), max_new_tokens=4)  # fmt: skip
    data = PromptDataModule(ArithmeticTask(num_digits=3, train_size=32, eval_size=8), "{question}=",
                            prompts_per_rollout=2, minibatches_per_rollout=2, eval_batch_size=8)  # fmt: skip
    engine = ReservedAtSetup()
    sampler = GroupSampler(rewards=[length_reward], group_size=4, num_minibatches=2, engine=engine)
    evaluation = HeldOutEvaluation(correct=ExactAnswer(), every_n_steps=100, samples_per_prompt=3)
    callbacks = [evaluation, sampler] if evaluation_first else [sampler, evaluation]
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                         callbacks=callbacks)  # fmt: skip
    trainer.fit(module, data)
    longest = max(len(module.tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"])
                  for a in (999,) for b in (999,))  # fmt: skip  # 3-digit prompts: "999+999=" is the longest
    training = RoundNeed(2 * 4, longest + 4)  # P x G, the longest prompt with max_new_tokens
    held_out = RoundNeed(8 * 3, longest + 4)  # eval_batch_size x samples_per_prompt
    assert engine.at_setup == (training.merged(held_out) if evaluation_first else training)
    assert engine.need == training.merged(held_out)
