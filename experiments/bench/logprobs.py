"""Peak memory and time of per-token log-probs through a realistic LM head, forward + backward.

    python experiments/bench/logprobs.py                             # about 12 minutes on 2 CPU cores
    python experiments/bench/logprobs.py --device cuda --dtype bfloat16

Headline: vocabulary 151,936 and hidden size 1,024 (Qwen3-0.6B's head), 8 responses x 1,024 tokens. Both paths
start from the final hidden states [N, H] and the head weight [V, H] (both requiring grad) and end with the
gradients of ``sum(upstream * logprobs)``:

- naive: ``logits = hidden @ W.T``; ``log_softmax(logits.float()).gather(tokens)``, as most trainers do;
- chunked: :func:`gspo_lightning.chunked_logprobs.chunked_head_logprobs` (the package's default path).

Every measurement runs in a fresh subprocess. Peak memory is what the computation adds on top of its inputs:
on CPU the peak resident set size (``VmHWM``, reset through ``/proc/self/clear_refs`` right before) minus the
resident size before; on CUDA ``max_memory_allocated`` minus the allocated bytes before. Then two sweeps show
how peak memory grows with the number of tokens and with the vocabulary.
"""

from __future__ import annotations

import argparse
import json
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

MB = 2**20


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
    logits = hidden @ weight.T  # [N, V] in the model's dtype
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)  # [N]


def worker(settings: dict) -> dict:
    """One path at one size: seconds and peak bytes of each repetition of forward + backward."""
    device, dtype = torch.device(settings["device"]), getattr(torch, settings["dtype"])
    generator = torch.Generator(device).manual_seed(0)
    n, h, v = settings["tokens"], settings["hidden"], settings["vocab"]
    hidden = (torch.randn(n, h, generator=generator, device=device) * 0.5).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=generator, device=device) * h**-0.5).to(dtype).requires_grad_()
    tokens = torch.randint(0, v, (n,), generator=generator, device=device)
    upstream = torch.randn(n, generator=generator, device=device)
    seconds, peaks = [], []
    for _ in range(settings["reps"]):
        hidden.grad = weight.grad = None
        with PeakMemory(device) as memory:
            started = time.perf_counter()
            if settings["path"] == "naive":
                logprobs = naive_logprobs(hidden, weight, tokens)
            else:
                logprobs = chunked_head_logprobs(hidden, weight, tokens, chunk_size=settings["chunk_size"])[0]
            (logprobs * upstream).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        peaks.append(memory.peak)
        del logprobs
    return {"seconds": seconds, "peak_bytes": peaks}


def measure(path: str, tokens: int, vocab: int, args: argparse.Namespace, reps: int) -> dict:
    """Run :func:`worker` in a fresh process, so one measurement's allocations cannot shape another's."""
    settings = {
        "path": path, "tokens": tokens, "vocab": vocab, "hidden": args.hidden, "chunk_size": args.chunk_size,
        "device": args.device, "dtype": args.dtype, "reps": reps,
    }  # fmt: skip
    command = [sys.executable, __file__, "--worker", json.dumps(settings)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def headline(args: argparse.Namespace) -> None:
    tokens = args.responses * args.response_tokens
    print(f"\n## {args.responses} x {args.response_tokens} tokens, V={args.vocab}, H={args.hidden}, "
          f"{args.dtype}, forward + backward, {args.reps} repetitions (median, min-max)\n")  # fmt: skip
    results = {path: measure(path, tokens, args.vocab, args, args.reps) for path in ("naive", "chunked")}
    print("| path | seconds | peak memory (MB) | time / naive | memory / naive |")
    print("| --- | --- | --- | --- | --- |")
    naive_s, naive_mb = (statistics.median(results["naive"][k]) for k in ("seconds", "peak_bytes"))
    for path, result in results.items():
        seconds, peak = statistics.median(result["seconds"]), statistics.median(result["peak_bytes"])
        print(f"| {path} | {spread(result['seconds'])} | {spread([b / MB for b in result['peak_bytes']])} | "
              f"{seconds / naive_s:.2f}x | {peak / naive_mb:.1%} |")  # fmt: skip


def sweep(args: argparse.Namespace, label: str, points: list[tuple[int, int]]) -> None:
    print(f"\n## peak memory (MB) as {label} grows (1 repetition each, chunk_size={args.chunk_size})\n")
    print("| tokens | vocab | naive | chunked | chunked / naive |")
    print("| --- | --- | --- | --- | --- |")
    for tokens, vocab in points:
        naive, chunked = (measure(path, tokens, vocab, args, 1)["peak_bytes"][0] for path in ("naive", "chunked"))
        print(f"| {tokens} | {vocab} | {naive / MB:.0f} | {chunked / MB:.0f} | {chunked / naive:.1%} |")


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
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, device {args.device}")  # fmt: skip
    headline(args)
    sweep(args, "the number of tokens N grows", [(n, args.vocab) for n in args.sweep_tokens])
    sweep(args, "the vocabulary V grows", [(args.sweep_vocab_tokens, v) for v in args.sweep_vocab])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
