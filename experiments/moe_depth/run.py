"""Claim 3 against depth: the fraction of activated experts that one update changes, on MoE policies of 4 to 48
layers at the same learning rate.

    python experiments/moe_depth/run.py                       # about 12 minutes on 2 CPU cores
    python experiments/moe_depth/run.py --device cuda --width 256

For each depth a randomly initialised ``TinyQwen3Moe`` (8 experts per layer, top-2, renormalised; width 64) samples
G=8 responses of 8 tokens for 16 quick-start prompts (temperature 1). The routers' choices on those tokens are
recorded (pi_old's routing), then one AdamW step of the GSPO loss (``gspo_loss``, paper clipping) is taken with
group-normalised advantages of random rewards (an untrained policy earns none: the advantages only give the
update a direction, as a reward would), and the routing on the same tokens is recorded again.
``expert_change_fraction`` per layer is the share of activated (token, expert) pairs that the update replaced:
the paper reports ~10% for a 48-layer MoE after each gradient update (section 5.3).

Writes beside this file: ``results.csv`` (one row per depth, learning rate and seed, with the per-layer fractions),
``moe_depth.png``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

from gspo_lightning.logprobs import response_logprobs  # noqa: E402
from gspo_lightning.models import TinyQwen3Moe  # noqa: E402
from gspo_lightning.moe.routing import capture_routes, expert_change_fraction  # noqa: E402
from gspo_lightning.objectives.advantages import group_advantages  # noqa: E402
from gspo_lightning.objectives.gspo import gspo_loss  # noqa: E402

HERE = Path(__file__).parent
DEPTHS = (4, 12, 24, 48)
PROMPTS, GROUP, RESPONSE = 16, 8, 8


def rollout(policy, tokenizer, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + sampled response ids [P * G, Lp + R] and their mask, from quick-start addition prompts."""
    from transformers import GenerationConfig

    generator = torch.Generator().manual_seed(seed)
    numbers = torch.randint(100, 1000, (PROMPTS, 2), generator=generator).tolist()
    prompts = tokenizer([f"{a}+{b}=" for a, b in numbers], return_tensors="pt", padding=True).to(device)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=RESPONSE,
                              min_new_tokens=RESPONSE, num_return_sequences=GROUP, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(seed)
    ids = policy.generate(**prompts, generation_config=config)  # [P * G, Lp + R]
    mask = torch.cat([prompts.attention_mask.repeat_interleave(GROUP, 0), torch.ones_like(ids[:, -RESPONSE:])], 1)
    return ids, mask


def routes(policy, ids, mask) -> torch.Tensor:
    with torch.no_grad(), capture_routes(policy, tuple(ids.shape)) as capture:
        policy(input_ids=ids, attention_mask=mask)
    return capture.stacked()  # [n, layers, L, k]


def one_update(depth: int, lr: float, seed: int, args) -> dict:
    loader = TinyQwen3Moe(hidden_size=args.width, num_layers=depth, num_heads=2, num_kv_heads=1,
                          moe_intermediate_size=args.width, seed=seed)  # fmt: skip
    tokenizer = loader.load_tokenizer()
    policy = loader.load_model(tokenizer).to(args.device)
    ids, mask = rollout(policy.eval(), tokenizer, seed, args.device)
    old_routes = routes(policy, ids, mask)
    with torch.no_grad():
        old_logprobs = response_logprobs(policy, ids, mask, RESPONSE)  # [N, R]
    generator = torch.Generator().manual_seed(seed + 1)
    advantages = group_advantages(torch.rand(PROMPTS * GROUP, generator=generator).round(), GROUP).to(args.device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    started = time.perf_counter()
    policy.train()
    logprobs = response_logprobs(policy, ids, mask, RESPONSE)  # [N, R]
    loss, _ = gspo_loss(logprobs, old_logprobs, advantages, torch.ones_like(logprobs), 3e-4, 4e-4)
    loss.backward()
    optimizer.step()
    policy.eval()
    changed = expert_change_fraction(old_routes, routes(policy, ids, mask), mask)  # [layers]
    per_layer = changed.tolist()
    quarter = max(1, depth // 4)
    return {
        "depth": depth, "lr": lr, "seed": seed, "changed_mean": sum(per_layer) / depth,
        "changed_first_quarter": sum(per_layer[:quarter]) / quarter,
        "changed_last_quarter": sum(per_layer[-quarter:]) / quarter, "changed_max": max(per_layer),
        "update_seconds": round(time.perf_counter() - started, 2),
        "per_layer": " ".join(f"{value:.4f}" for value in per_layer),
    }  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    figure, axes = common.grid_figure(1, 2, (12, 4.5))
    colors = dict(zip(DEPTHS, ["tab:blue", "tab:green", "tab:orange", "tab:red"]))
    for lr, style in zip(sorted({r["lr"] for r in rows}), ("o-", "s--")):
        means = [[100 * r["changed_mean"] for r in rows if r["depth"] == d and r["lr"] == lr] for d in DEPTHS]
        axes[0].plot(DEPTHS, [sum(m) / len(m) for m in means], style, color="black", label=f"lr {lr:g}: all layers")
        for depth in DEPTHS:
            mine = [r for r in rows if r["depth"] == depth and r["lr"] == lr]
            layers = [[float(v) for v in r["per_layer"].split()] for r in mine]
            average = [100 * sum(column) / len(column) for column in zip(*layers)]
            relative = [(layer + 0.5) / depth for layer in range(depth)]
            label = f"{depth} layers, lr {lr:g}"
            axes[1].plot(relative, average, style, color=colors[depth], markersize=3, label=label)
    axes[0].axhline(10, color="gray", lw=0.8, label="paper: ~10% at 48 layers")
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    common.finish_axes(axes, [("layers", "experts changed by one update (%)"),
                              ("relative depth of the layer", "experts changed by one update (%)")])  # fmt: skip
    common.save_figure(figure, "MoE routing volatility after one GSPO update, against depth (mean over seeds)", path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 1e-4], help="1e-4: the quick start's")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = [one_update(depth, lr, seed, args) for depth in DEPTHS for lr in args.lrs for seed in args.seeds]
    common.write_csv(HERE / "results.csv", rows)
    plot(rows, HERE / "moe_depth.png")
    columns = {
        "layers": "{depth}", "lr": "{lr:g}", "seed": "{seed}", "changed, all layers": "{changed_mean:.2%}",
        "first quarter": "{changed_first_quarter:.2%}", "last quarter": "{changed_last_quarter:.2%}",
        "max layer": "{changed_max:.2%}",
    }  # fmt: skip
    print(f"TinyQwen3Moe, random weights, width {args.width}, 8 experts top-2; device {args.device}; "
          f"{time.perf_counter() - started:.0f} s")  # fmt: skip
    common.print_table(rows, columns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
