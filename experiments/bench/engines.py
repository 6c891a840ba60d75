"""Tokens/s and seconds per optimizer step of the two sampling engines: ``hf`` (``generate``) and ``vllm``.

    python experiments/bench/engines.py                                  # CPU, about 15 minutes on 2 cores
    python experiments/bench/engines.py --device cuda --dtype bfloat16 --hidden 1024 --layers 28 --heads 16 \
        --kv-heads 8 --intermediate 3072 --vocab-size 151936               # a Qwen3-0.6B-shaped random model

1. **Generation throughput.** P prompts x G responses of exactly L tokens each (EOS held off with
   ``min_new_tokens`` / ``min_tokens``, so every engine generates the same number of tokens), for L from 32 to
   1,024, through gspo_lightning's own engine classes (``HFEngine`` with the shared prompt prefill,
   ``VLLMEngine``) on one random-weight Qwen3 (no weights can be downloaded). tokens/s = P * G * L / seconds,
   median of the repetitions after one warm-up call.
2. **Seconds per optimizer step.** The training loop (``GroupSampler`` + ``GSPOModule``, K = 4, a reward that
   always varies) on the same model with each engine and ``old_logprobs: engine``, responses capped at M tokens
   (they end at EOS as the model samples it): the mean over the steps after the first round (one round in K
   steps samples; engine start-up and the first round excluded), with the sampling share of it.

Every measurement runs in a fresh process (vLLM initialises torch.distributed in the process it runs in).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _model(args: dict):
    import torch

    from gspo_lightning import GSPOModule
    from gspo_lightning.models import TinyQwen3
    from gspo_lightning.models.char_tokenizer import ASCII_ALPHABET

    torch.manual_seed(0)
    loader = TinyQwen3(
        hidden_size=args["hidden"], num_layers=args["layers"], num_heads=args["heads"], num_kv_heads=args["kv_heads"],
        intermediate_size=args["intermediate"], max_position_embeddings=2048, alphabet=ASCII_ALPHABET,
    )  # fmt: skip
    return loader, GSPOModule(loader, max_new_tokens=args["max_new"], log_entropy=False)


def fixed_length_classes():
    """Sampling settings for ``generate`` and a vLLM engine that make every response exactly ``max_new_tokens``
    long (EOS held off with ``min_new_tokens`` / ``min_tokens``)."""
    from gspo_lightning.engines import VLLMEngine
    from gspo_lightning.engines.base import SamplingSettings

    class FixedLengthSettings(SamplingSettings):
        def generation_config(self, tokenizer):
            config = super().generation_config(tokenizer)
            config.min_new_tokens = self.max_new_tokens
            return config

    class FixedLengthVLLM(VLLMEngine):
        def _sampling_params(self, settings, with_logprobs, seed):
            params = super()._sampling_params(settings, with_logprobs, seed)
            params.min_tokens = settings.max_new_tokens
            return params

    return FixedLengthSettings, FixedLengthVLLM


def _engine(name: str, fixed_length: bool):
    """The engine, made to generate exactly ``max_new_tokens`` tokens when ``fixed_length`` (EOS held off)."""
    from gspo_lightning.engines import HFEngine, VLLMEngine
    from gspo_lightning.engines.base import SamplingSettings

    FixedLengthSettings, FixedLengthVLLM = fixed_length_classes()
    engine = HFEngine() if name == "hf" else (FixedLengthVLLM() if fixed_length else VLLMEngine())
    return engine, (FixedLengthSettings if fixed_length else SamplingSettings)


def throughput_worker(args: dict) -> dict:
    """Part 1 in this process: seconds of each repetition of one P x G x L sampling call."""
    from types import SimpleNamespace

    import torch

    from gspo_lightning.rollout.pipeline import encode_prompts

    torch.set_grad_enabled(False)
    _, module = _model(args)
    module.configure_model()
    module.to(args["device"])
    engine, settings_class = _engine(args["engine"], fixed_length=True)
    trainer = SimpleNamespace(world_size=1, global_rank=0, local_rank=0, global_step=0, precision=args["precision"], strategy=None)
    started = time.perf_counter()
    engine.setup(trainer, module)
    setup_s = time.perf_counter() - started
    prompts = [f"{i * 7919 % 100000:05d}+{i * 104729 % 100000:05d} = ?" for i in range(args["prompts"])]
    ids, mask = encode_prompts(module.tokenizer, prompts, args["device"])
    settings = settings_class(args["max_new"], temperature=1.0)
    seconds, tokens = [], 0
    for repetition in range(args["reps"] + 1):  # the first call warms up
        started = time.perf_counter()
        with torch.autocast(args["device_type"], dtype=torch.bfloat16, enabled=args["precision"] == "bf16-mixed"):
            samples = engine.sample(module.policy, module.tokenizer, ids, mask, settings, args["group"], seed=repetition)
        if args["device_type"] == "cuda":
            torch.cuda.synchronize()
        if repetition:
            seconds.append(time.perf_counter() - started)
            tokens = int((samples.response_ids != module.tokenizer.pad_token_id).sum())
    engine.teardown()
    return {"seconds": seconds, "tokens": tokens, "setup_s": setup_s}


def step_worker(args: dict) -> dict:
    """Part 2 in this process: per-step seconds of a short training run with one engine."""
    import lightning.pytorch as pl
    import torch

    from gspo_lightning import GroupSampler
    from gspo_lightning.data import ArithmeticTask, PromptDataModule
    from tests.fault_helpers import length_reward

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.steps: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.steps.append(time.perf_counter() - self._started)

    _, module = _model(args)
    engine, _ = _engine(args["engine"], fixed_length=False)
    sampling: list[float] = []
    sample = engine.sample

    def timed_sample(*arguments, **keywords):
        started = time.perf_counter()
        samples = sample(*arguments, **keywords)
        sampling.append(time.perf_counter() - started)
        return samples

    engine.sample = timed_sample
    k = 4
    sampler = GroupSampler(rewards=[length_reward], group_size=args["group"], num_minibatches=k, engine=engine, old_logprobs="engine")  # fmt: skip
    data = PromptDataModule(ArithmeticTask(num_digits=5, train_size=512, eval_size=8), "{question}=",
                            prompts_per_rollout=args["prompts"], minibatches_per_rollout=k)  # fmt: skip
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator=args["device_type"], devices=1, precision=args["precision"], max_steps=args["rounds"] * k,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer, sampler],  # the timer first: its step starts before the sampler samples
    )  # fmt: skip
    torch.manual_seed(0)
    trainer.fit(module, data)
    steps = timer.steps[k:]  # after the first round: engine start-up and warm-up excluded
    return {"step_s": statistics.fmean(steps), "generate_s_per_round": statistics.fmean(sampling[1:])}


def _run(worker: str, settings: dict) -> dict | None:
    command = [sys.executable, __file__, "--worker", worker, json.dumps(settings)]
    environment = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE=str(settings["kv_cache_gib"]))
    result = subprocess.run(command, capture_output=True, text=True, env=environment)
    if result.returncode != 0:
        print(f"<!-- {worker} {settings['engine']} failed ({result.returncode}): {result.stderr[-600:]} -->")
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--engines", nargs="*", default=["hf", "vllm"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="*", default=[32, 128, 512, 1024])
    parser.add_argument("--step-lengths", type=int, nargs="*", default=[32, 256])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    args = parser.parse_args()
    if args.worker:
        worker, settings = args.worker
        print(json.dumps({"throughput": throughput_worker, "step": step_worker}[worker](json.loads(settings))))
        return 0
    base = {
        "device": args.device, "device_type": args.device.split(":")[0], "hidden": args.hidden, "layers": args.layers,
        "heads": args.heads, "kv_heads": args.kv_heads, "intermediate": args.intermediate, "prompts": args.prompts,
        "group": args.group, "reps": args.reps, "rounds": args.rounds, "kv_cache_gib": args.kv_cache_gib,
        "precision": "bf16-mixed" if args.dtype == "bfloat16" else "32-true",
    }  # fmt: skip
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, device {args.device}, {base['precision']}; "
          f"random Qwen3 width {args.hidden}, {args.layers} layers; P={args.prompts} x G={args.group}")  # fmt: skip
    print("\n## generation throughput (responses of exactly L tokens)\n")
    print("| L | engine | seconds per call | generated tokens/s | engine start (s) |")
    print("| --- | --- | --- | --- | --- |")
    for length in args.lengths:
        for engine in args.engines:
            result = _run("throughput", {**base, "engine": engine, "max_new": length})
            if result is None:
                continue
            seconds = statistics.median(result["seconds"])
            print(f"| {length} | {engine} | {seconds:.2f} | {result['tokens'] / seconds:.0f} | {result['setup_s']:.1f} |")
    print("\n## seconds per optimizer step (training loop, K = 4, old_logprobs: engine)\n")
    print("| max_new_tokens | engine | s / optimizer step | sampling s / round |")
    print("| --- | --- | --- | --- |")
    for length in args.step_lengths:
        for engine in args.engines:
            result = _run("step", {**base, "engine": engine, "max_new": length})
            if result is not None:
                print(f"| {length} | {engine} | {result['step_s']:.3f} | {result['generate_s_per_round']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
