"""Issue 28, part 2: GSPO, GSPO-token with per-turn advantages and GRPO on multi-turn tool-use episodes.

    python experiments/episodes/run.py             # 5 variants x 4 seeds, about 60 minutes on 2 cores
    python experiments/episodes/run.py --seeds 0 --steps 20 --out /tmp/episodes   # a quick look
    python experiments/episodes/run.py --replot    # tables and plot again from progress.jsonl

The multi-turn demo (``configs/tool_calculator.yaml``: 3-digit multiplication with a calculator tool, up to 3
turns, 8 prompts x 8 episodes a round, K = 4, 400 steps), held-out greedy success (final answer right, 128
problems) every 25 steps. Its only reward is the final answer's, and then per-turn advantages equal the
episode's and GSPO-token equals GSPO (Eqs. 13-17; the objectives' tests check it). So the three objectives run
with one change that gives per-turn advantages something to do: the environment pays ``BONUS`` = 0.2 on the first
turn whose tool calls all run and answer without an error (``CalculatorCallBonus``, once per episode), and
``environment_reward`` is added to ``ExactAnswer``: an episode's reward is 0.2 [called] + 1 [right].

- ``gspo``: one sequence ratio over all the policy's tokens of the episode (every turn), one advantage;
- ``gspo_token``: the same ratio, but each turn's tokens get the group-normalised return from that turn on
  (``sampler.episodes.turn_advantages: true``): the call turn is credited with the bonus and the answer, the
  answer turn with the answer only;
- ``grpo``: per-token ratios (clip 0.2 / 0.27), one advantage per episode;
- ``gspo, demo reward`` and ``grpo, demo reward``: the demo as it is (final answer only).

The ``RatioNoise`` callback records, for every episode of every minibatch, its turns, policy tokens, context
tokens (prompt, tool results and template between turns), the log of its sequence ratio pi_theta / pi_old
(before that step's update; 0 on a round's first minibatch) and the log-ratio bf16 autocast / float32 at the same
weights (the rounding noise an engine in bf16 would add), summarised by turns.

The demo's episodes have 1 or 2 turns and 30-45 context tokens, so a controlled sweep without training follows:
part 3's random Qwen3 with a peaked head (``experiments/length_correction``, logit scale 30), 32 episodes of 16
turns, each turn 32 tokens sampled by the bf16 weights, then 0, 32 or 256 random observation tokens (a tool's
answer); the fp32 trainer recomputes them. A causal model's first k turns do not depend on later ones, so each
episode gives k = 1, 2, 4, 8, 16. The std of log s_i (bf16 against fp32) is set against std(d_t) / sqrt(policy
tokens), what independent per-token noise would give.

Results: ``results.csv`` (one row per run), ``curves.csv``, ``noise.csv`` (the ratio's spread by turns),
``sweep.csv``, ``output.txt``, ``episodes.png``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import shutil
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

from gspo_lightning.episodes import ToolEnvironment, calculator  # noqa: E402
from gspo_lightning.episodes.environment import Step  # noqa: E402
from gspo_lightning.logprobs import response_logprobs  # noqa: E402
from gspo_lightning.objectives.gspo import sequence_log_ratio  # noqa: E402

HERE = Path(__file__).resolve().parent
CONFIG = common.ROOT / "configs/tool_calculator.yaml"
BONUS = 0.2
EVERY = 25
VARIANTS = {  # name -> (flags, with the call bonus)
    "gspo": (["--model.init_args.objective=gspo"], True),
    "gspo_token": (["--model.init_args.objective=gspo_token", "--sampler.episodes.turn_advantages=true"], True),
    "grpo": (["--model.init_args.objective=grpo"], True),
    "gspo, demo reward": (["--model.init_args.objective=gspo"], False),
    "grpo, demo reward": (["--model.init_args.objective=grpo"], False),
}
SOLVED = 0.8  # the held-out success whose first evaluation step measures learning speed
CURVE_KEYS = ("eval/accuracy", "eval/tool_calls_mean", "rollout/reward_mean", "rollout/turns_mean",
              "train/clip_frac", "diag/clip_frac_resp")  # fmt: skip
NOISE_COLUMNS = ("step", "minibatch", "turns", "policy_tokens", "context_tokens", "log_ratio", "token_std",
                 "bf16_log_ratio", "bf16_token_std")  # fmt: skip
OVERLAY = f"""
sampler:
  rewards:
    - class_path: gspo_lightning.rewards.ExactAnswer
    - gspo_lightning.episodes.environment_reward
  episodes:
    tools: []
    environment:
      class_path: experiments.episodes.run.CalculatorCallBonus
      init_args:
        bonus: {BONUS}
"""


class CalculatorCallBonus(ToolEnvironment):
    """The demo's calculator loop with a per-turn reward: ``bonus`` on the first turn whose tool calls all ran
    and answered without an error (once per episode, so calls cannot be farmed)."""

    def __init__(self, bonus: float = BONUS) -> None:
        super().__init__([calculator])
        self.bonus = bonus
        self.paid = False

    def step(self, turn: str) -> Step:
        step = super().step(turn)
        answered = all(not m["content"].startswith("error") for m in step.observation or [])
        if step.tool_calls and not step.tool_errors and answered and not self.paid:
            self.paid = True
            return replace(step, reward=step.reward + self.bonus)
        return step


class RatioNoise(pl.Callback):
    """Per episode of each minibatch, appended to ``ratio_noise.csv``: turns, policy and context tokens, log s_i of
    pi_theta (the weights this step's gradient is taken at) against pi_old, and of bf16 autocast against float32 at
    those weights; with each response's per-token standard deviation of the same log-ratios."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batch = batch

    @torch.no_grad()
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        minibatch = self.batch.minibatch
        width = minibatch.response_ids.shape[1]
        inputs = (pl_module.policy, minibatch.input_ids, minibatch.attention_mask, width, pl_module.temperature,
                  pl_module.logprob_chunk_size, pl_module.batch_layout)  # fmt: skip
        theta = response_logprobs(*inputs)  # [n, R] what training_step computed
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = response_logprobs(*inputs)  # [n, R]
        mask = minibatch.response_mask
        columns = [*episode_shape(mask, minibatch.attention_mask), *log_ratio_spread(theta, minibatch.old_logprobs, mask),
                   *log_ratio_spread(bf16, theta, mask)]  # fmt: skip
        with open("ratio_noise.csv", "a") as handle:
            for row in zip(*(c.tolist() for c in columns)):
                if row[1] > 0:  # an episode left out of the loss (truncated) has no policy tokens here
                    handle.write(f"{trainer.global_step},{self.batch.minibatch_index}," + ",".join(map(str, row)) + "\n")


def episode_shape(response_mask: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Turns (runs of policy tokens), policy tokens and context tokens (the rest of what the episode attends to:
    prompt, tool results, template) of each row: [n] each, from response_mask [n, R] and attention_mask [n, L]."""
    mask = response_mask != 0  # [n, R]
    turns = mask[:, 0].long() + (mask[:, 1:] & ~mask[:, :-1]).sum(-1)  # [n]
    policy_tokens = mask.sum(-1)  # [n]
    return turns, policy_tokens, attention_mask.sum(-1) - policy_tokens


def log_ratio_spread(numerator: torch.Tensor, denominator: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """log s_i (Eq. 7) of each row [n] and the standard deviation of its per-token log-ratios [n] (n - 1 in the
    denominator; 0 for a single token)."""
    token_mask = mask != 0  # [n, R]
    mean = sequence_log_ratio(numerator, denominator, mask)  # [n]
    difference = torch.where(token_mask, numerator - denominator - mean[:, None], 0.0)  # [n, R]
    variance = (difference**2).sum(-1) / (token_mask.sum(-1) - 1).clamp(min=1)  # [n]
    return mean, variance.sqrt()


def run_one(variant: str, seed: int, args, work: Path) -> dict:
    workdir = work / f"{variant.replace(', ', '_').replace(' ', '_')}_{seed}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    flags, bonus = VARIANTS[variant]
    (workdir / "overlay.yaml").write_text(OVERLAY if bonus else "{}\n")
    overrides = ["-c", "overlay.yaml", f"--trainer.max_steps={args.steps}", f"--evaluation.every_n_steps={EVERY}",
                 "--trainer.callbacks+=experiments.episodes.run.RatioNoise", *common.seed_overrides(seed), *flags]  # fmt: skip
    result = common.run_fit(workdir, overrides, work / f"cache_{seed}", config=CONFIG)
    steps = result["steps"]
    curve = [{"step": s, **{k: row.get(k, math.nan) for k in CURVE_KEYS}} for s, row in sorted(steps.items())]
    noise = [dict(zip(NOISE_COLUMNS, map(float, line.split(","))))
             for line in (workdir / "ratio_noise.csv").read_text().split()]  # fmt: skip
    accuracy = [(s, row["eval/accuracy"]) for s, row in sorted(steps.items()) if "eval/accuracy" in row]
    summary = {
        "variant": variant, "seed": seed, "seconds": round(result["seconds"], 1),
        "success_start": accuracy[0][1], "success_end": accuracy[-1][1], "success_best": max(a for _, a in accuracy),
        "gain_points": 100 * (accuracy[-1][1] - accuracy[0][1]), "success_mean": statistics.mean(a for _, a in accuracy),
        "steps_to_solved": next((s for s, a in accuracy if a >= SOLVED), math.nan),
        "reward_last100": statistics.mean(r["rollout/reward_mean"] for r in curve[-100:] if not math.isnan(r["rollout/reward_mean"])),
        "clip_frac_tokens": common.mean_of(curve, "train/clip_frac"), "clip_frac_resp": common.mean_of(curve, "diag/clip_frac_resp"),
        "tool_calls_end": steps[accuracy[-1][0]].get("eval/tool_calls_mean", math.nan),
    }  # fmt: skip
    return {"summary": summary, "curve": curve, "noise": spread_table(noise)}


def spread_table(noise: list[dict]) -> list[dict]:
    """The ratio's spread over episodes, by turns: std of log s_i (pi_theta / pi_old on minibatches after a round's
    first, bf16 / fp32 on all), the mean per-token std, and the count."""
    rows = []
    for turns in sorted({int(r["turns"]) for r in noise}):
        members = [r for r in noise if int(r["turns"]) == turns]
        moved = [r for r in members if r["minibatch"] > 0]
        rows.append({
            "turns": turns, "episodes": len(members),
            "policy_tokens": statistics.mean(r["policy_tokens"] for r in members),
            "context_tokens": statistics.mean(r["context_tokens"] for r in members),
            "log_ratio_std": statistics.pstdev(r["log_ratio"] for r in moved) if len(moved) > 1 else math.nan,
            "token_std": statistics.mean(r["token_std"] for r in moved) if moved else math.nan,
            "bf16_log_ratio_std": statistics.pstdev(r["bf16_log_ratio"] for r in members) if len(members) > 1 else math.nan,
            "bf16_token_std": statistics.mean(r["bf16_token_std"] for r in members),
        })  # fmt: skip
    return rows


SWEEP_TURNS, SWEEP_TURN_TOKENS, SWEEP_CONTEXTS, SWEEP_EPISODES = (1, 2, 4, 8, 16), 32, (0, 32, 256), 32


@torch.no_grad()
def context_sweep(seed: int = 0) -> list[dict]:
    """bf16-vs-fp32 spread of log s_i against turns and observation tokens between them (no training)."""
    from transformers import GenerationConfig

    length = common.load_script(HERE.parent / "length_correction/run.py")
    settings = argparse.Namespace(seed=seed, vocab=8192, width=256, layers=4, responses=SWEEP_EPISODES,
                                  max_length=max(SWEEP_TURNS) * (SWEEP_TURN_TOKENS + max(SWEEP_CONTEXTS)))  # fmt: skip
    policy = length.build_policy(settings, 30.0)  # float32: the trainer
    behaviour = copy.deepcopy(policy).to(torch.bfloat16)  # the sampler's weights
    turn = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=SWEEP_TURN_TOKENS,
                            min_new_tokens=SWEEP_TURN_TOKENS, pad_token_id=0, eos_token_id=0)  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for context in SWEEP_CONTEXTS:
        torch.manual_seed(seed)
        ids = length.prompts(settings)  # [N, 16]
        prompt = ids.shape[1]
        policy_mask = torch.zeros_like(ids, dtype=torch.bool)  # [N, L]
        for _ in range(max(SWEEP_TURNS)):
            ids = behaviour.generate(ids, attention_mask=torch.ones_like(ids), generation_config=turn)  # [N, L + T]
            observation = torch.randint(1, settings.vocab, (len(ids), context), generator=generator)  # [N, c]
            policy_mask = torch.cat([policy_mask, torch.ones(len(ids), SWEEP_TURN_TOKENS, dtype=torch.bool),
                                     torch.zeros(len(ids), context, dtype=torch.bool)], dim=1)  # fmt: skip
            ids = torch.cat([ids, observation], dim=1)
        width = ids.shape[1] - prompt
        ones = torch.ones_like(ids)
        d = (response_logprobs(policy, ids, ones, width) - response_logprobs(behaviour, ids, ones, width)).double()
        mask = policy_mask[:, prompt:]  # [N, R]
        for turns in SWEEP_TURNS:
            span = turns * (SWEEP_TURN_TOKENS + context)  # the first k turns with the observations after them
            tokens = d[:, :span][mask[:, :span]].reshape(len(ids), -1)  # [N, k T] the policy's tokens
            rows.append({
                "context_per_turn": context, "turns": turns, "policy_tokens": tokens.shape[1],
                "context_tokens": prompt + (turns - 1) * context, "log_ratio_std": tokens.mean(-1).std().item(),
                "token_std": tokens.std().item(), "iid_prediction": tokens.std().item() / math.sqrt(tokens.shape[1]),
            })  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=HERE, help="where the results go (default: next to this script)")
    parser.add_argument("--replot", action="store_true", help="rebuild the tables and plot from progress.jsonl")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    progress = args.out / "progress.jsonl"
    done = common.read_progress(progress)
    if not args.replot:
        finished = {(d["summary"]["variant"], d["summary"]["seed"]) for d in done}
        for seed in args.seeds:
            for variant in args.variants:
                if (variant, seed) in finished:
                    continue
                done.append(run_one(variant, seed, args, args.out / "work"))
                common.append_progress(progress, done[-1])
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in done[-1]["summary"].items()}, flush=True)
        shutil.rmtree(args.out / "work", ignore_errors=True)
    sweep_csv = args.out / "sweep.csv"
    if not args.replot and not sweep_csv.exists():
        common.write_csv(sweep_csv, context_sweep())
    sweep = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(sweep_csv.open())] if sweep_csv.exists() else []
    report(done, sweep, args)
    return 0


def report(done: list[dict], sweep: list[dict], args) -> None:
    for d in done:  # turns per training episode over the last 50 steps
        d["summary"]["turns_end"] = common.mean_of(d["curve"][-50:], "rollout/turns_mean")
    common.write_csv(args.out / "results.csv", [d["summary"] for d in done])
    common.write_csv(args.out / "curves.csv", [{"variant": d["summary"]["variant"], "seed": d["summary"]["seed"], **p}
                                               for d in done for p in d["curve"]])  # fmt: skip
    noise = [{"variant": d["summary"]["variant"], "seed": d["summary"]["seed"], **row} for d in done for row in d["noise"]]
    common.write_csv(args.out / "noise.csv", noise)
    lines = [f"# python experiments/episodes/run.py --steps {args.steps}  ({common.machine()})", "",
             f"| variant | success start -> end (per seed) | mean over evaluations | first step at {SOLVED:.0%} (per seed) "
             "| reward, last 100 steps | clip frac (tokens) | clip frac (responses) | turns, last 50 steps |",
             "|" + " --- |" * 8]  # fmt: skip
    for variant in VARIANTS:
        rows = [d["summary"] for d in done if d["summary"]["variant"] == variant]
        if not rows:
            continue
        per_seed = ", ".join(f"{100 * r['success_start']:.1f} -> {100 * r['success_end']:.1f}" for r in rows)
        solved = ", ".join("-" if math.isnan(r["steps_to_solved"]) else f"{r['steps_to_solved']:.0f}" for r in rows)
        lines.append(
            f"| {variant} | {per_seed} | {100 * statistics.mean(r['success_mean'] for r in rows):.1f}% | {solved} "
            f"| {statistics.mean(r['reward_last100'] for r in rows):.3f} | {statistics.mean(r['clip_frac_tokens'] for r in rows):.4f} "
            f"| {statistics.mean(r['clip_frac_resp'] for r in rows):.4f} | {statistics.mean(r['turns_end'] for r in rows):.2f} |"
        )  # fmt: skip
    lines += ["", "Spread of the sequence log-ratio over episodes, by turns (the seeds pooled; pi_theta / pi_old on a round's "
              "minibatches 2-4, bf16 / fp32 on all)", "",
              "| variant | turns | episodes | policy tokens | context tokens | std log s (theta/old) | per-token std "
              "| std log s (bf16/fp32) | per-token std (bf16) |", "|" + " --- |" * 9]  # fmt: skip
    for variant in VARIANTS:
        mine = [r for r in noise if r["variant"] == variant]
        for turns in sorted({r["turns"] for r in mine}):
            rows = [r for r in mine if r["turns"] == turns]

            def pooled(key: str) -> float:  # the seeds' figures weighted by their episodes
                pairs = [(r[key], r["episodes"]) for r in rows if not math.isnan(r[key])]
                return sum(v * w for v, w in pairs) / sum(w for _, w in pairs) if pairs else math.nan

            lines.append(f"| {variant} | {turns} | {sum(r['episodes'] for r in rows)} | {pooled('policy_tokens'):.0f} "
                         f"| {pooled('context_tokens'):.0f} | {pooled('log_ratio_std'):.2e} | {pooled('token_std'):.2e} "
                         f"| {pooled('bf16_log_ratio_std'):.2e} | {pooled('bf16_token_std'):.2e} |")  # fmt: skip
    lines += ["", "Controlled sweep (no training; random peaked Qwen3, bf16 sampler against the fp32 trainer, "
              f"{SWEEP_EPISODES} episodes, {SWEEP_TURN_TOKENS} policy tokens a turn)", "",
              "| observation tokens per turn | turns | policy tokens | context tokens | std log s (bf16/fp32) "
              "| per-token std | std(d_t) / sqrt(policy tokens) |", "|" + " --- |" * 7]  # fmt: skip
    lines += [f"| {r['context_per_turn']:.0f} | {r['turns']:.0f} | {r['policy_tokens']:.0f} | {r['context_tokens']:.0f} "
              f"| {r['log_ratio_std']:.2e} | {r['token_std']:.2e} | {r['iid_prediction']:.2e} |" for r in sweep]  # fmt: skip
    (args.out / "output.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(done, sweep, args.out / "episodes.png")


def plot(done: list[dict], sweep: list[dict], path: Path) -> None:
    figure, axes = common.grid_figure(1, 4, (24, 5))
    for variant, color in zip(VARIANTS, ["tab:blue", "tab:orange", "tab:red", "tab:cyan", "tab:pink"]):
        runs = [d for d in done if d["summary"]["variant"] == variant]
        if not runs:
            continue
        evaluated = [[p for p in d["curve"] if not math.isnan(p["eval/accuracy"])] for d in runs]
        common.plot_band(axes[0], [([p["step"] for p in e], [100 * p["eval/accuracy"] for p in e]) for e in evaluated],
                         variant, color)  # fmt: skip
        clip = [([p["step"] for p in d["curve"]], common.smooth([p["diag/clip_frac_resp"] for p in d["curve"]], 20)) for d in runs]
        common.plot_band(axes[1], clip, variant, color)
        turns = [r for d in runs for r in d["noise"] if not math.isnan(r["log_ratio_std"])]
        bins = sorted({r["turns"] for r in turns})
        axes[2].plot(bins, [statistics.mean(r["log_ratio_std"] for r in turns if r["turns"] == b) for b in bins], "o-",
                     color=color, label=f"{variant}: pi_theta / pi_old")  # fmt: skip
        axes[2].plot(bins, [statistics.mean(r["bf16_log_ratio_std"] for r in turns if r["turns"] == b) for b in bins], "s--",
                     color=color, label=f"{variant}: bf16 / fp32")  # fmt: skip
    for context, color in zip(SWEEP_CONTEXTS, ["tab:green", "tab:purple", "tab:brown"]):
        mine = [r for r in sweep if r["context_per_turn"] == context]
        axes[3].plot([r["turns"] for r in mine], [r["log_ratio_std"] for r in mine], "o-", color=color,
                     label=f"{context} observation tokens a turn")  # fmt: skip
        axes[3].plot([r["turns"] for r in mine], [r["iid_prediction"] for r in mine], ":", color=color)
    axes[2].set_yscale("log")
    axes[3].set_xscale("log", base=2)
    axes[3].set_yscale("log")
    common.finish_axes(axes, [("optimizer step", "held-out greedy success (%)"),
                              ("optimizer step", "clip fraction (responses; moving average 20)"),
                              ("policy turns in the episode", "std of log s_i over episodes"),
                              ("turns (sweep, no training)", "std of log s_i, bf16 / fp32 (dotted: iid)")])  # fmt: skip
    common.save_figure(figure, "Multi-turn calculator episodes: mean, band = min-max over seeds", path)


if __name__ == "__main__":
    raise SystemExit(main())
