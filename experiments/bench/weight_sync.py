"""Seconds per weight sync and per sampling round against model size: a vLLM server's file sync against the
colocated engine's in-place load, and a LoRA policy's adapter-only sync to a server.

    python experiments/bench/weight_sync.py               # four sizes up to Qwen3-0.6B's shape, about 20 min on 2 cores
    python experiments/bench/weight_sync.py --sizes 40M   # one size

Random-weight Qwen3s (Qwen3's vocabulary of 151,936 tokens, tied embeddings as in Qwen3-0.6B; no weights can be
downloaded), float32 on the CPU. For each size, in a fresh process per engine:

- ``vllm_server``: a server the engine starts on core 1, the measuring process on core 0. A sync is what every
  round pays: ``snapshot_weights`` (the weights written once as safetensors under ``/dev/shm`` and the trainer's
  probe log-probs) and ``load_snapshot`` (pause, ``collective_rpc("reload_weights")``, prefix-cache reset, resume,
  the probe on the server);
- ``vllm``: the colocated engine (both cores), whose ``sync_weights`` loads each decoder layer's tensors in place
  (no file) and resets the prefix cache;
- ``vllm_server_lora``: the same server, the policy wrapped in a rank-16 LoRA on every linear layer (peft), synced
  as its adapter alone (``lora_sync: auto``): the adapter written as peft writes it, ``/v1/load_lora_adapter``
  under a new name, the probe under it, the previous name unloaded.

Each sync follows a change to every trained weight (so nothing is skipped as unchanged); a round is P x G = 8 x 4 responses
of up to 16 tokens. Median of ``--reps`` after one warm-up. Results: ``weight_sync_output.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
OUTPUT = Path(__file__).with_name("weight_sync_output.txt")
SIZES = {  # name: (hidden, layers, heads, kv heads, intermediate, head_dim)
    "40M": (256, 4, 4, 2, 768, 64),
    "110M": (512, 8, 8, 4, 1536, 64),
    "260M": (768, 16, 12, 4, 2304, 64),
    "0.6B": (1024, 28, 16, 8, 3072, 128),  # Qwen3-0.6B's shape
}
ENGINES = ("vllm_server", "vllm", "vllm_server_lora")
LORA_RANK = 16


def _module(size: str, lora: bool) -> SimpleNamespace:
    import peft
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from gspo_lightning.models import TinyQwen3
    from gspo_lightning.models.char_tokenizer import ASCII_ALPHABET

    hidden, layers, heads, kv_heads, intermediate, head_dim = SIZES[size]
    config = Qwen3Config(vocab_size=151936, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate, head_dim=head_dim,
                         max_position_embeddings=256, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    policy = Qwen3ForCausalLM(config).eval()
    if lora:
        adapter = peft.LoraConfig(task_type="CAUSAL_LM", r=LORA_RANK, lora_alpha=2 * LORA_RANK,
                                  target_modules="all-linear")  # fmt: skip
        policy = peft.get_peft_model(policy, adapter).eval()
    tokenizer = TinyQwen3(alphabet=ASCII_ALPHABET, max_position_embeddings=256).load_tokenizer()
    return SimpleNamespace(policy=policy, tokenizer=tokenizer, device=torch.device("cpu"), routing_replay="off")


def worker(size: str, engine_name: str, reps: int) -> dict:
    """One engine on one size, in this process: seconds per sync and per round."""
    import torch

    from gspo_lightning.engines import VLLMEngine, VLLMServerEngine
    from gspo_lightning.engines.base import SamplingSettings
    from gspo_lightning.rollout.pipeline import encode_prompts

    torch.set_grad_enabled(False)
    module = _module(size, engine_name == "vllm_server_lora")
    parameters = sum(p.numel() for n, p in module.policy.named_parameters() if ".lora_" not in n)
    trainer = SimpleNamespace(world_size=1, global_rank=0, local_rank=0, global_step=0, precision="32-true",
                              strategy=None, precision_plugin=SimpleNamespace(forward_context=nullcontext))  # fmt: skip
    server = engine_name.startswith("vllm_server")
    engine = VLLMServerEngine(cpu_cores=["1"], port=8251) if server else VLLMEngine()
    started = time.perf_counter()
    engine.setup(trainer, module)
    setup_s = time.perf_counter() - started
    ids, mask = encode_prompts(module.tokenizer, [f"{i * 37 % 1000}+{i * 91 % 1000}=" for i in range(8)], "cpu")
    settings = SamplingSettings(16, temperature=1.0)
    syncs, rounds, sent = [], [], []
    for step in range(1, reps + 2):  # the first of each warms up
        for parameter in module.policy.parameters():
            if parameter.requires_grad:  # all of a plain policy; the adapter's (its B starts at 0) of a LoRA one
                parameter.mul_(1.0 + 1e-3).add_(1e-4)
        trainer.global_step = step
        if server:
            engine.take_figures()
        started = time.perf_counter()
        if server:
            engine.load_snapshot(engine.snapshot_weights(trainer, module))
            sent.append(engine.take_figures()["sync_bytes"])
        else:
            engine.sync_weights(trainer, module)
        synced = time.perf_counter()
        engine.sample(module.policy, module.tokenizer, ids, mask, settings, 4, with_logprobs=True, seed=step)
        if step > 1:
            syncs.append(synced - started)
            rounds.append(time.perf_counter() - synced)
    engine.teardown()
    return {"parameters": parameters, "setup_s": setup_s, "sync_s": statistics.median(syncs),
            "round_s": statistics.median(rounds), "sync_mb": statistics.median(sent) / 1e6 if sent else None}


def _in_fresh_process(size: str, engine: str, reps: int) -> dict:
    prefix = ["taskset", "-c", "0"] if engine.startswith("vllm_server") else []
    command = [*prefix, sys.executable, __file__, "--worker", size, engine, str(reps)]
    environment = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1")
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(f"{engine} at {size} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        size, engine, reps = args.worker
        print(json.dumps(worker(size, engine, int(reps))))
        return
    lines = [f"# python experiments/bench/weight_sync.py --sizes {' '.join(args.sizes)} --reps {args.reps}  "
             f"({platform.machine()}, {os.cpu_count()} cores; float32, CPU)",
             "| size | parameters | engine | start s | sync s | MB sent per sync | round s (8 x 4 x 16 tokens) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for size in args.sizes:
        for engine in ENGINES:
            figures = _in_fresh_process(size, engine, args.reps)
            sent = "in place" if figures["sync_mb"] is None else f"{figures['sync_mb']:.1f}"
            lines.append(f"| {size} | {figures['parameters'] / 1e6:.0f}M | {engine} | {figures['setup_s']:.1f} | "
                         f"{figures['sync_s']:.2f} | {sent} | {figures['round_s']:.2f} |")  # fmt: skip
            print(lines[-1], flush=True)
    OUTPUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
