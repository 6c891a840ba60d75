"""The vLLM engine's checks, in a process of their own (vLLM initialises torch.distributed in-process).

    python tests/engines/vllm_checks.py --out results.json

Builds a GSPOModule with a tiny random Qwen3 and a VLLMEngine, then records what the tests in
``test_vllm_engine.py`` assert: output shapes and EOS handling, log-probs against the trainer's before and after
the trainer's weights change (weight sync), greedy parity with ``generate``, and seeded reproducibility; then the
same after a sync with prompts that share a prefix of several KV blocks (the prefix cache must not serve blocks
computed under the old weights), and the quick start's batch (16 prompts x 8) with long prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gspo_lightning import GSPOModule  # noqa: E402
from gspo_lightning.engines import HFEngine, VLLMEngine  # noqa: E402
from gspo_lightning.engines.base import SamplingSettings  # noqa: E402
from gspo_lightning.logprobs import response_logprobs  # noqa: E402
from gspo_lightning.models import TinyQwen3  # noqa: E402
from gspo_lightning.models.loaders import DEFAULT_ALPHABET  # noqa: E402
from gspo_lightning.engines.base import response_mask_until_eos  # noqa: E402
from gspo_lightning.rollout.pipeline import encode_prompts  # noqa: E402

PROMPTS, G, MAX_NEW = ["1+1=", "12+34=", "7"], 4, 8
SHARED = "Add the two numbers. 12+34=46, 7+8=15, 100+1=101. "  # a system prompt / few-shot header, repeated


def logprob_gap(module, prompt_ids, prompt_mask, samples, group) -> float:
    """Largest |engine log-prob - trainer log-prob| over the response tokens, in float32."""
    response_mask, _ = response_mask_until_eos(samples.response_ids, module.tokenizer.eos_token_id)
    input_ids = torch.cat([prompt_ids.repeat_interleave(group, 0), samples.response_ids], 1)
    attention = torch.cat([prompt_mask.repeat_interleave(group, 0), response_mask], 1)
    with torch.no_grad():
        trainer = response_logprobs(module.policy, input_ids, attention, samples.response_ids.shape[1])
    return float(((trainer - samples.logprobs).abs() * response_mask).max())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    tiny = TinyQwen3(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                     alphabet="".join(sorted(set(DEFAULT_ALPHABET + SHARED))), max_position_embeddings=1024)  # fmt: skip
    module = GSPOModule(tiny)
    module.configure_model()
    tokenizer = module.tokenizer
    trainer = SimpleNamespace(world_size=1, global_rank=0, local_rank=0, global_step=0, precision="32-true", strategy=None)
    engine = VLLMEngine(enforce_eager=True, seed=7)
    engine.setup(trainer, module)
    ids, mask = encode_prompts(tokenizer, PROMPTS, "cpu")
    settings = SamplingSettings(MAX_NEW, temperature=1.0)
    first = engine.sample(module.policy, tokenizer, ids, mask, settings, G, with_logprobs=True, seed=11)
    again = engine.sample(module.policy, tokenizer, ids, mask, settings, G, with_logprobs=True, seed=11)
    other = engine.sample(module.policy, tokenizer, ids, mask, settings, G, with_logprobs=True, seed=12)
    response_mask, truncated = response_mask_until_eos(first.response_ids, tokenizer.eos_token_id)
    after_end = first.response_ids[response_mask == 0]
    results = {
        "shape": list(first.response_ids.shape),
        "logprobs_shape": list(first.logprobs.shape),
        "ended_matches_eos": bool(torch.equal(first.ended, ~truncated)),
        "some_ended": bool(first.ended.any()),
        "pad_after_end": bool((after_end == tokenizer.pad_token_id).all()),
        "distinct_in_group": len({tuple(row) for row in first.response_ids[:G].tolist()}),
        "same_seed_same_samples": bool(torch.equal(first.response_ids, again.response_ids)),
        "other_seed_differs": not torch.equal(first.response_ids, other.response_ids),
        "gap_initial": logprob_gap(module, ids, mask, first, G),
    }
    with torch.no_grad():  # the trainer's weights move; the engine still holds the old ones until the sync
        for parameter in module.policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    stale = engine.sample(module.policy, tokenizer, ids, mask, settings, G, with_logprobs=True, seed=11)
    results["gap_stale"] = logprob_gap(module, ids, mask, stale, G)
    trainer.global_step = 1
    engine.before_rollout(trainer, module)
    synced = engine.sample(module.policy, tokenizer, ids, mask, settings, G, with_logprobs=True, seed=11)
    results["gap_synced"] = logprob_gap(module, ids, mask, synced, G)
    greedy = SamplingSettings(MAX_NEW, temperature=0.0)
    engine_greedy = engine.sample(module.policy, tokenizer, ids, mask, greedy, 1)
    hf_greedy = HFEngine().sample(module.policy, tokenizer, ids, mask, greedy, 1)
    engine_mask, _ = response_mask_until_eos(engine_greedy.response_ids, tokenizer.eos_token_id)
    hf_mask, _ = response_mask_until_eos(hf_greedy.response_ids, tokenizer.eos_token_id)
    results["greedy_equal"] = [
        engine_row[: int(e)].tolist() == hf_row[: int(h)].tolist()
        for engine_row, hf_row, e, h in zip(engine_greedy.response_ids, hf_greedy.response_ids,
                                            engine_mask.sum(-1), hf_mask.sum(-1))  # fmt: skip
    ]
    results |= shared_prefix_checks(engine, module, trainer, settings)
    engine.teardown()
    Path(args.out).write_text(json.dumps(results))


def shared_prefix_checks(engine, module, trainer, settings) -> dict:
    """Prompts sharing a prefix longer than several KV blocks, sampled before and after the weights change and
    sync; then 16 prompts x 8 responses whose prefills together exceed one scheduler step."""
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    prefix = (SHARED * 40)[: 3 * block + 5]  # three full blocks the prefix cache keeps, and a partial one
    ids, mask = encode_prompts(module.tokenizer, [prefix + "1+1=", prefix + "22+3="], "cpu")
    before = engine.sample(module.policy, module.tokenizer, ids, mask, settings, G, with_logprobs=True, seed=5)
    gap_before = logprob_gap(module, ids, mask, before, G)  # now: the trainer's weights move next
    with torch.no_grad():
        for parameter in module.policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    trainer.global_step += 1
    engine.before_rollout(trainer, module)
    after = engine.sample(module.policy, module.tokenizer, ids, mask, settings, G, with_logprobs=True, seed=5)
    batch = [(SHARED * 3)[:120] + f"{i}+{i}=" for i in range(16)]
    batch_ids, batch_mask = encode_prompts(module.tokenizer, batch, "cpu")
    big = engine.sample(module.policy, module.tokenizer, batch_ids, batch_mask, settings, 8, with_logprobs=True, seed=9)
    return {
        "long_prompt_tokens": int(ids.shape[1]),
        "block_size": block,
        "gap_long_before": gap_before,
        "gap_long_synced": logprob_gap(module, ids, mask, after, G),
        "big_batch_shape": list(big.response_ids.shape),
        "gap_big_batch": logprob_gap(module, batch_ids, batch_mask, big, 8),
    }


if __name__ == "__main__":
    main()
