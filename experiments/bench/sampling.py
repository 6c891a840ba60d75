"""Sampling time: a bare ``generate`` against gspo_lightning's sampling, with and without a shared prompt prefill.

    python experiments/bench/sampling.py                                    # a few minutes on 2 CPU cores
    python experiments/bench/sampling.py --prompt-lengths 16 64 --reps 1   # a quick look
    python experiments/bench/sampling.py --device cuda --dtype bfloat16

For each prompt length Lp it builds one batch of P prompts, each to be answered G times, and times:

- ``bare generate``: ``policy.generate`` on the P x G repeated rows, called directly;
- ``generate_responses``: gspo_lightning's plain path (``sampler.share_prompt_prefill: false``);
- ``... share_prefill``: the same with ``share_prefill=True`` (``sampler.share_prompt_prefill: true``, the
  default): the prompts' prefill runs once per prompt, its key/value cache repeated G times.

The policy is a randomly initialised Qwen3 (``Qwen3ForCausalLM``, transformers' default attention);
its default vocabulary of 4096 keeps the LM head's share of the compute near Qwen3-0.6B's (about a quarter).
The prompts are random token ids, left-padded: prompt i has a length drawn in [Lp/2, Lp], the longest exactly Lp.
Sampling is at temperature 1 with no top-p / top-k, from a fixed seed. The model has no EOS token (and the
sampling settings none), so every call generates exactly ``max_new_tokens`` tokens per row (checked), and
all variants do the same work. After a warm-up call of each variant, the variants take turns within each
repetition, so that a change of load on the machine hits them alike. tokens/s counts generated tokens
(P x G x max_new_tokens) over the median time; "vs bare" is the median time over the bare call's.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from torch import Tensor, nn
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gspo_lightning.engines.base import SamplingSettings  # noqa: E402
from gspo_lightning.engines.hf import generate_responses  # noqa: E402

PAD = 0
Variant = Callable[[nn.Module, Tensor, Tensor], Tensor]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[16, 128, 512, 1024], help="Lp values")
    parser.add_argument("--prompts", type=int, default=4, help="P, distinct prompts")
    parser.add_argument("--group-size", type=int, default=8, help="G, responses per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per variant, after one warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    return parser.parse_args()


def build_policy(args: argparse.Namespace) -> nn.Module:
    """A random Qwen3 without EOS: generation always runs to max_new_tokens."""
    config = Qwen3Config(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        max_position_embeddings=max(args.prompt_lengths) + args.max_new_tokens,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(args.seed)
    return Qwen3ForCausalLM(config).to(args.device, getattr(torch, args.dtype)).eval()


def make_prompts(count: int, length: int, vocab_size: int, seed: int, device: str) -> tuple[Tensor, Tensor]:
    """Random left-padded prompts [count, length] and their mask; the longest is exactly ``length`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, length // 2), length + 1, (count,), generator=generator)  # [P]
    lengths[0] = length
    ids = torch.randint(1, vocab_size, (count, length), generator=generator)  # [P, Lp], never PAD
    mask = (torch.arange(length) >= length - lengths[:, None]).long()  # [P, Lp], zeros on the left
    return ids.masked_fill(mask == 0, PAD).to(device), mask.to(device)


def variants(args: argparse.Namespace) -> dict[str, Variant]:
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0)
    # generate_responses reads only these two ids off the tokenizer; no EOS, so no early stop.
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=None)
    group = args.group_size

    def bare(policy: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
        sequences = policy.generate(
            input_ids=ids.repeat_interleave(group, dim=0),  # [P * G, Lp]
            attention_mask=mask.repeat_interleave(group, dim=0),  # [P * G, Lp]
            do_sample=True,
            max_new_tokens=args.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,  # as SamplingSettings(top_k=0): no truncation in either
            pad_token_id=PAD,
        )  # [P * G, Lp + R]
        return sequences[:, ids.shape[1] :]

    def plain(policy: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
        return generate_responses(policy, tokenizer, ids, mask, settings, group_size=group)

    def shared(policy: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
        return generate_responses(policy, tokenizer, ids, mask, settings, group_size=group, share_prefill=True)

    return {"bare generate": bare, "generate_responses": plain, "generate_responses share_prefill": shared}


def time_variants(
    policy: nn.Module, ids: Tensor, mask: Tensor, runs: dict[str, Variant], args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, Tensor]]:
    """Seconds of each timed call per variant, and each variant's responses from the seeded warm-up."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    responses = {}
    expected = (ids.shape[0] * args.group_size, args.max_new_tokens)
    for rep in range(args.reps + 1):  # rep 0 is the warm-up
        for name, run in runs.items():
            torch.manual_seed(args.seed)
            synchronize(ids.device)
            started = time.perf_counter()
            out = run(policy, ids, mask)  # [P * G, R]
            synchronize(ids.device)
            elapsed = time.perf_counter() - started
            if tuple(out.shape) != expected:
                raise RuntimeError(f"{name} returned {tuple(out.shape)}, expected {expected}: the work differs")
            if rep == 0:
                responses[name] = out
            else:
                seconds[name].append(elapsed)
    return seconds, responses


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that the clock measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def table_rows(length: int, seconds: dict[str, list[float]], tokens: int) -> list[str]:
    bare = statistics.median(next(iter(seconds.values())))  # the first variant is the bare call
    rows = []
    for name, values in seconds.items():
        median = statistics.median(values)
        rows.append(
            f"| {length} | {name} | {median:.3f} | {min(values):.3f}-{max(values):.3f} "
            f"| {tokens / median:,.0f} | {median / bare:.2f} |"
        )
    return rows


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    policy = build_policy(args)
    runs = variants(args)
    tokens = args.prompts * args.group_size * args.max_new_tokens
    gpu = f", GPU {torch.cuda.get_device_name(args.device)}" if args.device.startswith("cuda") else ""
    print(
        f"Machine: {platform.machine()} (processor {platform.processor() or 'unknown'}), "
        f"{os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads, "
        f"transformers {transformers.__version__}, Python {platform.python_version()}{gpu}"
    )
    print(
        f"Model: random Qwen3, hidden {args.hidden_size}, {args.layers} layers, {args.heads} heads "
        f"({args.kv_heads} key/value), MLP {args.intermediate_size}, vocabulary {args.vocab_size}, {args.dtype} "
        f"on {args.device}, attention {policy.config._attn_implementation}"
    )
    print(
        f"Batch: P={args.prompts} prompts x G={args.group_size} responses, {args.max_new_tokens} new tokens "
        f"each (no EOS), temperature 1, seed {args.seed}; {args.reps} timed repetitions after 1 warm-up\n"
    )
    print("| Lp | variant | seconds (median) | min-max | generated tokens/s | vs bare |")
    print("|---:|---|---:|---:|---:|---:|")
    notes = []
    for length in args.prompt_lengths:
        ids, mask = make_prompts(args.prompts, length, args.vocab_size, args.seed, args.device)  # [P, Lp] x2
        seconds, responses = time_variants(policy, ids, mask, runs, args)
        print("\n".join(table_rows(length, seconds, tokens)), flush=True)
        plain, shared = responses["generate_responses"], responses["generate_responses share_prefill"]
        same = (plain == shared).all(-1).sum().item()
        notes.append(f"Lp={length}: share_prefill drew the same tokens as the plain path in {same}/{len(plain)} rows")
    print("\nSame seed, same samples? " + "; ".join(notes))


if __name__ == "__main__":
    main()
