"""Seconds and peak memory of one optimizer step's training passes, padded against packed against packed with a
token budget, at Qwen3's vocabulary; and the whole step with sampling on both engines.

    python experiments/bench/packing.py > experiments/bench/packing_output.txt          # 25 minutes on 2 CPU cores
    python experiments/bench/packing.py --no-sampling > experiments/bench/packing_memory_output.txt   # 12 minutes
    python experiments/bench/packing.py --device cuda --dtype bfloat16

A random Qwen3-shaped policy (``Qwen3ForCausalLM``: vocabulary 151,936, hidden 256, 4 layers, 4 heads of 64, 2 KV
heads, MLP 768, tied embeddings as in Qwen3-0.6B), one minibatch of n = 16 responses (P x G = 16 x 8 with K = 8
minibatches per round): prompts of 24-64 tokens, responses from a long-tailed distribution between 16 and 1,024
tokens (15 of 16 + a log-normal with median 80 and sigma 1.2, cut at 1,024; the 16th truncated at the 1,024-token
budget, as RL batches hold: most are short, a few long), and the same at uniform lengths (every response 256
tokens, prompts 48). A step's training passes are pi_old's forward (no gradient) and
pi_theta's forward and backward of the GSPO loss, the chunked LM head predicting its gradient, as
``training_step`` runs them. Each variant runs in a fresh subprocess; peak memory is the peak resident set size
above the level before the passes (``VmHWM`` reset through ``/proc/self/clear_refs``), with allocations above
128 KB mapped one by one (``MALLOC_MMAP_THRESHOLD_``) so that freed memory leaves the resident set, or on CUDA
``max_memory_allocated`` above the allocated bytes before. (``packing_output.txt`` was measured before that
setting: its peaks are low by what glibc kept resident from the warm-up; ``packing_memory_output.txt`` has them.)

Variants: ``padded`` (the [n, prompt + response] rectangle), ``packed`` (``model.packing``), ``budget`` (packed
with ``model.micro_batch_tokens`` = 1,280: every pass micro-batch by micro-batch), and ``one budget``: the packed
passes of the budget's heaviest micro-batch alone, what one budget's worth of tokens needs, against which the
budget's peak is compared. The whole step adds the sampling of the minibatch's 16 responses at the same lengths:
Hugging Face ``generate`` (which decodes until the longest response is done) and vLLM (each request stopping at
its own length, ``ignore_eos``); packing changes only the training passes. ``--chunk-size``, ``--layers``,
``--variants`` and ``--distributions`` vary the measurement.
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

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from logprobs import MB, PeakMemory  # noqa: E402

from gspo_lightning.logprobs import response_logprobs, response_scores  # noqa: E402
from gspo_lightning.micro_batches import BatchLayout, plan_micro_batches  # noqa: E402
from gspo_lightning.objectives import ObjectiveSpec, objective_gradient, objective_loss  # noqa: E402

VOCAB, RESPONSES = 151_936, 16
SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, head_dim=64, num_key_value_heads=2,
             intermediate_size=768)  # fmt: skip
BUDGET = 1280  # tokens per micro-batch: the longest sequence (64 + 1,024) fits
LAYOUTS = {"padded": BatchLayout(), "packed": BatchLayout(packing=True), "budget": BatchLayout(True, BUDGET),
           "one budget": BatchLayout(packing=True)}  # fmt: skip


def lengths(distribution: str, seed: int = 0) -> tuple[list[int], list[int]]:
    """Prompt and response lengths of the minibatch's 16 sequences."""
    generator = torch.Generator().manual_seed(seed)
    if distribution == "uniform":
        return [48] * RESPONSES, [256] * RESPONSES
    prompts = torch.randint(24, 65, (RESPONSES,), generator=generator).tolist()
    tail = torch.empty(RESPONSES - 1).log_normal_(mean=float(torch.tensor(80.0).log()), std=1.2, generator=generator)
    return prompts, [*(16 + tail).clamp(max=1024).long().tolist(), 1024]  # the last one truncated at the budget


def batch(distribution: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded prompts and right-padded responses, as the sampler assembles a minibatch."""
    prompts, responses = lengths(distribution)
    width_p, width_r = max(prompts), max(responses)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (RESPONSES, width_p + width_r), generator=generator)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        mask[i, width_p - p : width_p + r] = 1
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device), width_r


def policy(device: torch.device, dtype: torch.dtype, layers: int = SHAPE["num_hidden_layers"]) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape = {**SHAPE, "num_hidden_layers": layers}
    config = Qwen3Config(vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=2048, **shape)
    return Qwen3ForCausalLM(config).to(device=device, dtype=dtype).eval()


def heaviest_micro_batch(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the budget's micro-batch with the most tokens."""
    plan = plan_micro_batches(LAYOUTS["budget"].costs(mask), BUDGET)
    rows = torch.tensor(max(plan, key=lambda group: int(mask[group].sum())))
    return ids[rows], mask[rows]


def training_passes(model, ids, mask, width, layout: BatchLayout, chunk: int) -> None:
    """pi_old's pass, then pi_theta's forward and backward of the GSPO loss (LM-head chunks of ``chunk`` tokens)."""
    response_mask = mask[:, -width:].bool()  # [n, R]
    with torch.no_grad():
        old = response_logprobs(model, ids, mask, width, chunk_size=chunk, layout=layout)  # [n, R]
    advantages = torch.linspace(-1, 1, len(ids), device=ids.device)  # [n]
    spec = ObjectiveSpec("gspo")
    terms = (old - 1e-3 * response_mask, advantages, response_mask, 3e-4, 4e-4)
    scores = response_scores(model, ids, mask, width, chunk_size=chunk,
                             predict_upstream=objective_gradient(spec, *terms), layout=layout)  # fmt: skip
    loss, _ = objective_loss(spec, scores.logprobs, *terms)
    loss.backward()


def measure(settings: dict) -> dict:
    """One variant, in this process: a warm-up step, then the timed ones."""
    device, dtype = torch.device(settings["device"]), getattr(torch, settings["dtype"])
    model = policy(device, dtype, settings["layers"])
    ids, mask, width = batch(settings["distribution"], device)
    if settings["variant"] == "one budget":
        ids, mask = heaviest_micro_batch(ids, mask)
    layout = LAYOUTS[settings["variant"]]
    chunk = settings["chunk_size"]
    training_passes(model, ids, mask, width, layout, chunk)  # warm-up (allocator, kernels)
    model.zero_grad(set_to_none=True)
    seconds = []
    with PeakMemory(device) as peak:
        for _ in range(settings["repeats"]):
            started = time.perf_counter()
            training_passes(model, ids, mask, width, layout, chunk)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
    real = int(mask.sum())
    return {**settings, "seconds": statistics.median(seconds), "peak_mb": peak.peak / MB, "real_tokens": real,
            "padded_tokens": mask.numel()}  # fmt: skip


def sampling_seconds(settings: dict) -> float:
    """Seconds to sample the minibatch's 16 responses at the distribution's lengths (after a warm-up call)."""
    device, dtype = torch.device(settings["device"]), getattr(torch, settings["dtype"])
    prompts, responses = lengths(settings["distribution"])
    generator = torch.Generator().manual_seed(2)
    prompt_ids = [torch.randint(3, VOCAB, (p,), generator=generator).tolist() for p in prompts]
    if settings["engine"] == "hf":
        model = policy(device, dtype)
        width = max(prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids], device=device)  # left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
        longest = max(responses)  # generate decodes every row until the longest one is done

        def sample(warm_up: bool = False) -> None:
            tokens = 8 if warm_up else longest
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=tokens,
                               min_new_tokens=tokens, pad_token_id=0, eos_token_id=None)  # fmt: skip
    else:
        import tempfile

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, as the project's engines set it on CPUs
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        import vllm

        directory = tempfile.mkdtemp(prefix="bench_packing_")
        config = policy(torch.device("meta"), dtype).config
        config.architectures = ["Qwen3ForCausalLM"]
        config.save_pretrained(directory)
        engine = vllm.LLM(model=directory, load_format="dummy", skip_tokenizer_init=True, dtype=settings["dtype"],
                          enforce_eager=device.type != "cuda", max_model_len=2048, enable_chunked_prefill=False,
                          max_num_batched_tokens=4096, seed=0)  # fmt: skip
        requests = [{"prompt_token_ids": p} for p in prompt_ids]

        def sample(warm_up: bool = False) -> None:
            params = [vllm.SamplingParams(max_tokens=8 if warm_up else r, ignore_eos=True, detokenize=False)
                      for r in responses]  # fmt: skip
            engine.generate(requests, params, use_tqdm=False)

    sample(warm_up=True)  # kernels, allocator
    started = time.perf_counter()
    sample()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def run_fresh(settings: dict) -> dict:
    command = [sys.executable, __file__, "--measure", json.dumps(settings)]
    # Allocations above 128 KB mapped and unmapped one by one: freed memory leaves the resident set at once, so
    # the peak above the level before the passes counts what the passes hold (glibc otherwise keeps a warm-up's
    # freed heap resident, and the next passes reuse it unseen).
    environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072"))
    result = subprocess.run(command, capture_output=True, text=True, env=environment)
    if result.returncode != 0:
        raise RuntimeError(f"{settings} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def passes_table(args, distribution: str) -> dict:
    base = args.variants[0]
    print(f"| variant | seconds per step | peak memory (MB) | tokens computed | speed-up | peak vs {base} |")
    print("| --- | --- | --- | --- | --- | --- |")
    results = {}
    for variant in args.variants:
        settings = dict(device=args.device, dtype=args.dtype, distribution=distribution, variant=variant,
                        repeats=args.repeats, chunk_size=args.chunk_size, layers=args.layers)  # fmt: skip
        results[variant] = result = run_fresh(settings)
        tokens = result["padded_tokens"] if variant == "padded" else result["real_tokens"]
        speedup = results[base]["seconds"] / result["seconds"]
        memory = result["peak_mb"] / results[base]["peak_mb"]
        print(f"| {variant} | {result['seconds']:.2f} | {result['peak_mb']:.0f} | {tokens} | {speedup:.2f}x | "
              f"{memory:.2f}x |", flush=True)  # fmt: skip
    if {"budget", "one budget"} <= results.keys():
        ratio = results["budget"]["peak_mb"] / results["one budget"]["peak_mb"]
        print(f"\nbudget ({BUDGET} tokens per micro-batch): peak {ratio:.2f}x one budget's "
              f"({results['one budget']['real_tokens']} tokens alone)")  # fmt: skip
    print()
    print()
    return results


def whole_step_table(args, distribution: str, passes: dict) -> None:
    print("| engine | sampling (s) | step padded (s) | step packed (s) | step budget (s) | packed speed-up |")
    print("| --- | --- | --- | --- | --- | --- |")
    for engine in ("hf", "vllm"):
        settings = dict(device=args.device, dtype=args.dtype, distribution=distribution, engine=engine)
        sampling = run_fresh({**settings, "sampling": True})["seconds"]
        steps = {variant: sampling + passes[variant]["seconds"] for variant in ("padded", "packed", "budget")}
        print(f"| {engine} | {sampling:.2f} | {steps['padded']:.2f} | {steps['packed']:.2f} | {steps['budget']:.2f} "
              f"| {steps['padded'] / steps['packed']:.2f}x |", flush=True)  # fmt: skip
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=1024, help="model.logprob_chunk_size")
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="decoder layers")
    parser.add_argument("--variants", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--distributions", nargs="+", default=["long_tailed", "uniform"])
    parser.add_argument("--no-sampling", action="store_true", help="the training passes only")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        settings = json.loads(args.measure)
        result = {"seconds": sampling_seconds(settings)} if settings.get("sampling") else measure(settings)
        print(json.dumps(result))
        return
    print(f"machine: {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"device {args.device}, {args.dtype}; policy {SHAPE} with {args.layers} layers, vocabulary {VOCAB}, "
          f"n = {RESPONSES}; "
          f"LM-head chunks of {args.chunk_size} tokens\n")  # fmt: skip
    for distribution in args.distributions:
        prompts, responses = lengths(distribution)
        print(f"## {distribution}: responses {sorted(responses)}, prompts {min(prompts)}-{max(prompts)}\n")
        passes = passes_table(args, distribution)
        if not args.no_sampling:
            whole_step_table(args, distribution, passes)


if __name__ == "__main__":
    main()
