"""Claim 4 without training: how far bf16 log-probs move the sequence ratio, against response length.

    python experiments/precision_length/run.py                 # about 2 minutes on 2 CPU cores
    python experiments/precision_length/run.py --device cuda --width 1024 --layers 16

One randomly initialised Qwen3 (no weights can be downloaded) samples N responses of 1,024 tokens in float32
(temperature 1, EOS suppressed). Their log-probs are then computed three ways: float32 (the trainer's recompute,
``gspo_lightning.logprobs.response_logprobs``), under bfloat16 autocast (what ``sampler.engine.sampling_dtype:
bfloat16`` does) and with the weights cast to bfloat16 (what a bf16 inference engine holds). A causal model's
log-probs of a response's first L tokens do not depend on the later ones, so one forward gives every length L in
8, 32, 128, 512, 1024: per token d_t = log pi_fp32 - log pi_bf16; GSPO's length-normalised sequence log-ratio
is the mean of d_t over the first L tokens (eq. 7). If the d_t were independent, its spread would fall like
std(d_t) / sqrt(L) (the paper's argument); the table and plot set the measurement against that prediction and
count the sequences whose ratio already leaves GSPO's clipping range [1 - 3e-4, 1 + 4e-4] before any update.

Writes beside this file: ``results.csv`` (one row per precision and length) and ``precision_length.png``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

from gspo_lightning.logprobs import response_logprobs  # noqa: E402

HERE = Path(__file__).parent
LENGTHS = (8, 32, 128, 512, 1024)
GSPO_LOW, GSPO_HIGH = 3e-4, 4e-4  # the paper's clipping range for GSPO


def build_policy(args) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.width, num_hidden_layers=args.layers, num_attention_heads=args.width // 64,
        num_key_value_heads=max(1, args.width // 128), head_dim=64, intermediate_size=3 * args.width,
        max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).to(args.device).eval()


@torch.no_grad()
def sample(policy, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [N, 16] of random tokens and N float32 samples of max(LENGTHS) tokens each -> (ids, mask)."""
    from transformers import GenerationConfig

    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(1, args.vocab, (args.responses, 16), generator=generator).to(args.device)
    length = max(LENGTHS)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=length,
                              min_new_tokens=length, pad_token_id=0, eos_token_id=0)  # fmt: skip
    ids = policy.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=config)  # [N, 16 + R]
    return ids, torch.ones_like(ids)


def token_log_ratios(policy, ids, mask) -> dict[str, torch.Tensor]:
    """d_t = log pi_fp32 - log pi_bf16 per token [N, R] (float64), for each bf16 variant."""
    length = max(LENGTHS)
    with torch.no_grad():
        exact = response_logprobs(policy, ids, mask, length).double()  # [N, R]
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            autocast = response_logprobs(policy, ids, mask, length).double()  # [N, R]
        weights_bf16 = response_logprobs(policy.to(torch.bfloat16), ids, mask, length).double()  # [N, R]
        policy.float()
    return {"bf16 autocast": exact - autocast, "bf16 weights": exact - weights_bf16}


def summarise(ratios: dict[str, torch.Tensor]) -> list[dict]:
    rows = []
    for precision, d in ratios.items():
        token_std_8 = d[:, : LENGTHS[0]].std().item()
        for length in LENGTHS:
            sequence = d[:, :length].mean(-1)  # [N] GSPO's length-normalised log-ratio (eq. 7)
            ratio = sequence.exp()
            token_std = d[:, :length].std().item()
            rows.append({
                "precision": precision, "length": length, "token_log_ratio_std": token_std,
                "sequence_log_ratio_std": sequence.std().item(),
                "independent_prediction": token_std / math.sqrt(length),
                "prediction_from_8": token_std_8 * math.sqrt(LENGTHS[0] / length),
                "ratio_p05": ratio.quantile(0.05).item(), "ratio_p95": ratio.quantile(0.95).item(),
                "outside_gspo_clip": ((ratio < 1 - GSPO_LOW) | (ratio > 1 + GSPO_HIGH)).double().mean().item(),
            })  # fmt: skip
    return rows


def plot(rows: list[dict], path: Path) -> None:
    figure, axes = common.grid_figure(1, 2, (12, 4.5))
    for precision, color in (("bf16 autocast", "tab:blue"), ("bf16 weights", "tab:red")):
        mine = [r for r in rows if r["precision"] == precision]
        lengths = [r["length"] for r in mine]
        axes[0].plot(lengths, [r["sequence_log_ratio_std"] for r in mine], "o-", color=color, label=f"{precision}: measured")
        axes[0].plot(lengths, [r["independent_prediction"] for r in mine], "--", color=color,
                     label=f"{precision}: std(d_t) / sqrt(L)")  # fmt: skip
        axes[0].plot(lengths, [r["token_log_ratio_std"] for r in mine], ":", color=color, label=f"{precision}: per token")
        axes[1].plot(lengths, [100 * r["outside_gspo_clip"] for r in mine], "o-", color=color, label=precision)
    axes[0].axhline(GSPO_LOW, color="gray", lw=0.8, label="GSPO eps_low 3e-4")
    for axis in axes:
        axis.set_xscale("log", base=2)
    axes[0].set_yscale("log")
    common.finish_axes(axes, [("response tokens L", "std of log-ratio (fp32 - bf16)"),
                              ("response tokens L", "sequences outside GSPO's clip range (%)")])  # fmt: skip
    common.save_figure(figure, "bf16 vs fp32 log-probs before any update, against response length", path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--responses", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    policy = build_policy(args)
    ids, mask = sample(policy, args)
    rows = summarise(token_log_ratios(policy, ids, mask))
    common.write_csv(HERE / "results.csv", rows)
    plot(rows, HERE / "precision_length.png")
    columns = {
        "precision": "{precision}", "L": "{length}", "std d_t": "{token_log_ratio_std:.2e}",
        "std seq log-ratio": "{sequence_log_ratio_std:.2e}", "std(d_t)/sqrt(L)": "{independent_prediction:.2e}",
        "ratio p05-p95": "{ratio_p05:.5f}-{ratio_p95:.5f}", "outside GSPO clip": "{outside_gspo_clip:.0%}",
    }  # fmt: skip
    print(f"model: Qwen3, random weights, width {args.width}, {args.layers} layers, vocab {args.vocab}; "
          f"{args.responses} responses; device {args.device}")  # fmt: skip
    common.print_table(rows, columns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
