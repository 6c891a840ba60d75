"""Peak memory and time of per-token log-probs through a realistic LM head, forward + backward.

    python experiments/bench/logprobs.py                             # about 12 minutes on 2 CPU cores
    python experiments/bench/logprobs.py --device cuda --dtype bfloat16

Headline: vocabulary 151,936 and hidden size 1,024 (Qwen3-0.6B's head), 8 responses x 1,024 tokens. Every path
starts from the final hidden states [n, R, H] and the head weight [V, H] (both requiring grad) and ends with
their gradients of the GSPO loss (paper clipping, pi_old slightly off pi_theta so that some responses clip):

- naive: ``logits = hidden @ W.T``; ``log_softmax(logits.float()).gather(tokens)``, as most trainers do;
- chunked: :func:`gspo_lightning.chunked_logprobs.chunked_head_logprobs` as ``training_step`` runs it, the
  objective's gradient predicted per chunk (``objective_gradient``) so the head's gradients form in forward;
- chunked_recompute: the same without the prediction: backward recomputes each chunk's logits.

Every measurement runs in a fresh subprocess. Peak memory is what the computation adds on top of its inputs:
on CPU the peak resident set size (``VmHWM``, reset through ``/proc/self/clear_refs`` right before) minus the
resident size before; on CUDA ``max_memory_allocated`` minus the allocated bytes before. Then two sweeps show
how peak memory grows with the number of tokens and with the vocabulary, and one long response (16,384 tokens)
shows that the chunked path's memory is bounded by the chunk size whatever the response length (the naive path
would need [16384, V] float32 tensors of 10 GB each there, and is not run).

    python experiments/bench/logprobs.py --sections long             # the long response alone, ~3 minutes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gspo_lightning.chunked_logprobs import chunked_head_logprobs  # noqa: E402
from gspo_lightning.objectives import (  # noqa: E402
    objective_gradient,  # noqa: E402
    objective_loss,
    resolve_objective,
)
from gspo_lightning.rollout.types import Minibatch  # noqa: E402

MB = 2**20
PATHS = ("naive", "chunked", "chunked_recompute")


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


class PeakMemory:
    """Bytes allocated above the level at entry, at the highest point inside the block."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
            self.before = _status_kb("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.before
        else:
            self.peak = _status_kb("VmHWM") * 1024 - self.before


def naive_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    logits = hidden @ weight.T  # [..., V] in the model's dtype
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)  # [...]


def setup(settings: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Minibatch]:
    """Hidden states [n, R, H] and head [V, H] requiring grad, tokens [n, R], and the minibatch the GSPO loss
    needs, with pi_old a little off pi_theta (some sequence ratios clip, as in training)."""
    device, dtype = torch.device(settings["device"]), getattr(torch, settings["dtype"])
    generator = torch.Generator(device).manual_seed(0)
    n, r, h, v = (
        settings["responses"],
        settings["tokens"] // settings["responses"],
        settings["hidden"],
        settings["vocab"],
    )
    hidden = (torch.randn(n, r, h, generator=generator, device=device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=generator, device=device) * h**-0.5).to(dtype).requires_grad_()
    tokens = torch.randint(0, v, (n, r), generator=generator, device=device)
    with torch.no_grad():
        current = chunked_head_logprobs(hidden, weight, tokens)[0]  # [n, R]
    shift = torch.linspace(-1e-3, 1e-3, n, device=device)[:, None]  # sequence ratios from e^-0.001 to e^0.001
    mask = torch.ones(n, r, device=device)
    advantages = torch.randn(n, generator=generator, device=device)
    minibatch = Minibatch(tokens, mask, tokens, mask, current + shift, advantages, advantages)
    return hidden, weight, tokens, minibatch


def loss_of(settings: dict, hidden, weight, tokens, minibatch: Minibatch) -> torch.Tensor:
    """The GSPO loss (paper clipping) on log-probs from the chosen path."""
    spec, eps = resolve_objective("gspo"), (3e-4, 4e-4)
    if settings["path"] == "naive":
        logprobs = naive_logprobs(hidden, weight, tokens)  # [n, R]
    else:
        predict = objective_gradient(
            spec, minibatch.old_logprobs, minibatch.advantages, minibatch.response_mask, *eps
        ) if settings["path"] == "chunked" else None
        logprobs = chunked_head_logprobs(
            hidden, weight, tokens, chunk_size=settings["chunk_size"], predict_upstream=predict
        )[0]  # [n, R]
    return objective_loss(spec, logprobs, minibatch.old_logprobs, minibatch.advantages, minibatch.response_mask, *eps)[
        0
    ]


def worker(settings: dict) -> dict:
    """One path at one size: seconds and peak bytes of each repetition of forward + backward."""
    hidden, weight, tokens, minibatch = setup(settings)
    device = hidden.device
    seconds, peaks = [], []
    for _ in range(settings["reps"]):
        hidden.grad = weight.grad = None
        with PeakMemory(device) as memory:
            started = time.perf_counter()
            loss_of(settings, hidden, weight, tokens, minibatch).backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        peaks.append(memory.peak)
    return {"seconds": seconds, "peak_bytes": peaks}


def measure(path: str, tokens: int, vocab: int, args: argparse.Namespace, reps: int) -> dict:
    """Run :func:`worker` in a fresh process, so one measurement's allocations cannot shape another's."""
    settings = {
        "path": path, "tokens": tokens, "vocab": vocab, "hidden": args.hidden, "chunk_size": args.chunk_size,
        "responses": args.responses,
        "device": args.device, "dtype": args.dtype, "reps": reps,
    }  # fmt: skip
    command = [sys.executable, __file__, "--worker", json.dumps(settings)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:  # killed for memory, most likely: say so in the table instead of stopping
        print(f"<!-- {path} at {tokens} tokens, V={vocab} failed ({result.returncode}): {result.stderr[-300:]} -->")
        return {"seconds": [math.nan], "peak_bytes": [math.nan]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def headline(args: argparse.Namespace) -> None:
    tokens = args.responses * args.response_tokens
    print(f"\n## {args.responses} x {args.response_tokens} tokens, V={args.vocab}, H={args.hidden}, "
          f"{args.dtype}, forward + backward, {args.reps} repetitions (median, min-max)\n")  # fmt: skip
    results = {path: measure(path, tokens, args.vocab, args, args.reps) for path in PATHS}
    print("| path | seconds | peak memory (MB) | time / naive | memory / naive |")
    print("| --- | --- | --- | --- | --- |")
    naive_s, naive_mb = (statistics.median(results["naive"][k]) for k in ("seconds", "peak_bytes"))
    for path, result in results.items():
        seconds, peak = statistics.median(result["seconds"]), statistics.median(result["peak_bytes"])
        print(f"| {path} | {spread(result['seconds'])} | {spread([b / MB for b in result['peak_bytes']])} | "
              f"{seconds / naive_s:.2f}x | {peak / naive_mb:.1%} |")  # fmt: skip


def sweep(args: argparse.Namespace, label: str, points: list[tuple[int, int]]) -> None:
    print(f"\n## peak memory (MB) as {label} (1 repetition each, chunk_size={args.chunk_size})\n")
    print("| tokens | vocab | naive | chunked | chunked / naive |")
    print("| --- | --- | --- | --- | --- |")
    for tokens, vocab in points:
        naive, chunked = (measure(path, tokens, vocab, args, 1)["peak_bytes"][0] for path in ("naive", "chunked"))
        print(f"| {tokens} | {vocab} | {naive / MB:.0f} | {chunked / MB:.0f} | {chunked / naive:.1%} |")


def long_response(args: argparse.Namespace) -> None:
    tokens = args.long_tokens
    print(f"\n## one response of {tokens} tokens, V={args.vocab}, H={args.hidden}, chunk_size={args.chunk_size}, "
          f"{args.dtype}, forward + backward, 1 repetition\n")  # fmt: skip
    long_args = argparse.Namespace(**{**vars(args), "responses": 1})
    print("| path | seconds | peak memory (MB) | one [tokens, V] float32 tensor (MB) |")
    print("| --- | --- | --- | --- |")
    for path in ("chunked", "chunked_recompute"):
        result = measure(path, tokens, args.vocab, long_args, 1)
        print(f"| {path} | {result['seconds'][0]:.1f} | {result['peak_bytes'][0] / MB:.0f} | "
              f"{tokens * args.vocab * 4 / MB:.0f} |")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--sweep-tokens", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--sweep-vocab", type=int, nargs="*", default=[32_768, 65_536, 151_936])
    parser.add_argument("--sweep-vocab-tokens", type=int, default=2048)
    parser.add_argument("--long-tokens", type=int, default=16_384)
    parser.add_argument("--sections", nargs="*", default=["headline", "tokens", "vocab", "long"],
                        choices=["headline", "tokens", "vocab", "long"])  # fmt: skip
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, device {args.device}")  # fmt: skip
    if "headline" in args.sections:
        headline(args)
    if "tokens" in args.sections:
        sweep(args, "the number of tokens N grows", [(n, args.vocab) for n in args.sweep_tokens])
    if "vocab" in args.sections:
        sweep(args, "the vocabulary V grows", [(args.sweep_vocab_tokens, v) for v in args.sweep_vocab])
    if "long" in args.sections:
        long_response(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
