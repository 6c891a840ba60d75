"""Peak memory of a training run by sampling engine: ``generate`` against vLLM with its KV cache sized from the
round (the default since issue 40) and with the fixed 1 GiB it had before.

    python experiments/bench/engine_memory.py            # about 6 minutes on 2 cores

A random 2-layer Qwen3 (width 256, Qwen3's vocabulary of 151,936, tied embeddings) with a character tokenizer,
trained for 2 rounds (P x G = 8 x 8 = 64 sequences a round, K = 4) with responses of up to 256 tokens (a random
model rarely samples EOS, so most run to the limit), float32 on the CPU, ``old_logprobs: engine``; each engine in a
fresh process (the colocated vLLM engine runs inside it). Peak memory is the process's largest resident set
(``ru_maxrss``), children included. Results: ``engine_memory_output.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
OUTPUT = Path(__file__).with_name("engine_memory_output.txt")
SHAPE = dict(vocab_size=151936, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=768, head_dim=64, max_position_embeddings=512, tie_word_embeddings=True)  # fmt: skip
ENGINES = {  # name: (engine, its arguments)
    "hf": ("hf", {}),
    "vllm (sized from the round)": ("vllm", {}),
    "vllm (kv_cache_gib: 1, as before)": ("vllm", {"kv_cache_gib": 1}),
}


def worker(model: str, engine: list) -> dict:
    """One training run in this process; its peak resident memory and the KV cache vLLM was given."""
    import lightning.pytorch as pl
    import torch
    from gspo_lightning import GroupSampler, GSPOModule
    from gspo_lightning.data import ArithmeticTask, PromptDataModule
    from gspo_lightning.engines import ENGINES as BY_NAME
    from gspo_lightning.engines import VLLMEngine
    from gspo_lightning.engines.vllm_options import kv_cache_bytes
    from gspo_lightning.models import Pretrained
    from tests.fault_helpers import length_reward

    name, arguments = engine
    built = BY_NAME[name](**arguments)
    torch.manual_seed(0)
    module = GSPOModule(Pretrained(model), max_new_tokens=256, log_entropy=False)
    data = PromptDataModule(ArithmeticTask(num_digits=3, train_size=256, eval_size=8), "{question}=",
                            prompts_per_rollout=8, minibatches_per_rollout=4)  # fmt: skip
    sampler = GroupSampler(rewards=[length_reward], group_size=8, num_minibatches=4, engine=built,
                           old_logprobs="engine")  # fmt: skip
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[sampler])  # fmt: skip
    trainer.fit(module, data)
    kv = None
    if isinstance(built, VLLMEngine):
        kv = (built.options.kv_cache_gib * 2**30 if built.options.kv_cache_gib else
              kv_cache_bytes(module.policy.config.to_dict(), "float32", built.need, 512))  # fmt: skip
    peak_kib = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                   resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)  # fmt: skip
    return {"peak_gb": peak_kib * 1024 / 1e9, "kv_gb": kv / 1e9 if kv else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], json.loads(args.worker[1]))))
        return
    from common import save_random_qwen3

    lines = [f"# python experiments/bench/engine_memory.py  ({platform.machine()}, {os.cpu_count()} cores; float32, "
             "CPU; 2-layer Qwen3, vocabulary 151,936, 64 sequences a round, responses up to 256 tokens)",
             "| engine | peak memory (GB) | KV cache (GB) |", "| --- | --- | --- |"]  # fmt: skip
    with tempfile.TemporaryDirectory() as model:
        save_random_qwen3(Path(model), SHAPE)
        for name, engine in ENGINES.items():
            environment = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
            result = subprocess.run([sys.executable, __file__, "--worker", model, json.dumps(engine)],
                                    capture_output=True, text=True, env=dict(environment, PYTHONPATH=str(ROOT)))
            if result.returncode != 0:
                raise RuntimeError(f"{name} failed:\n{result.stderr[-4000:]}")
            figures = json.loads(result.stdout.strip().splitlines()[-1])
            kv = f"{figures['kv_gb']:.3f}" if figures["kv_gb"] is not None else "-"
            lines.append(f"| {name} | {figures['peak_gb']:.2f} | {kv} |")
            print(lines[-1], flush=True)
    OUTPUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
