"""Shared pieces of the experiments: run the CLI, read its per-step metrics, summarise seeds, draw bands.

Every experiment runs ``python -m gspo_lightning fit`` with command-line overrides in its own working directory,
so what is measured is exactly what a user runs.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs/quickstart.yaml"
STEP_TIMES = ("time/generate_s", "time/reward_s", "time/old_logprob_s", "time/train_s")


def load_script(path: Path):
    """Another experiment's script as a module (for its settings), without running its ``main``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"experiment_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seed_overrides(seed: int) -> list[str]:
    """The seed applied to the RL run, the warm start and the prompt stream (as the quick-start experiment)."""
    return [
        f"--seed_everything={seed}",
        f"--model.init_args.policy.init_args.seed={seed}",
        f"--data.init_args.seed={seed}",
    ]


def run_fit(workdir: Path, overrides: Sequence[str], cache: Path, config: Path = QUICKSTART) -> dict:
    """Run one training run; return its per-step metrics and wall-clock seconds."""
    workdir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config), *overrides]
    command += ["--trainer.enable_progress_bar=false", "--trainer.logger.init_args.save_dir=runs"]
    environment = dict(os.environ, GSPO_LIGHTNING_CACHE=str(cache), PYTHONPATH=str(ROOT))
    started = time.perf_counter()
    result = subprocess.run(command, cwd=workdir, env=environment, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"run in {workdir} failed:\n{result.stderr[-4000:]}")
    metrics = next(workdir.glob("runs/*/version_0/metrics.csv"))
    return {"steps": per_step(metrics), "seconds": seconds}


def per_step(metrics_csv: Path) -> dict[int, dict[str, float]]:
    """Every logged value by step (the CSV logger writes several rows per step); empty cells skipped."""
    steps: dict[int, dict[str, float]] = defaultdict(dict)
    with metrics_csv.open() as handle:
        for row in csv.DictReader(handle):
            step = int(row["step"])
            for key, value in row.items():
                if key != "step" and value not in ("", None):
                    steps[step][key] = float(value)
    return dict(steps)


def training_clock(steps: dict[int, dict[str, float]]) -> dict[int, float]:
    """Cumulative seconds of sampling, scoring and training up to the end of each step (evaluations excluded)."""
    clock, total = {}, 0.0
    for step in sorted(steps):
        total += sum(steps[step].get(name, 0.0) for name in STEP_TIMES)
        clock[step] = total
    return clock


def series(steps: dict[int, dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where ``key`` was logged."""
    pairs = [(step, values[key]) for step, values in sorted(steps.items()) if key in values]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (NaNs ignored)."""
    out = []
    for index in range(len(values)):
        chunk = [v for v in values[max(0, index - window + 1) : index + 1] if not math.isnan(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def band(curves: list[tuple[list[float], list[float]]]) -> tuple[list[float], list[float], list[float], list[float]]:
    """x, mean, min and max of curves sampled at the same points (e.g. the same evaluation steps); x is the mean
    over curves, so a time axis shows each point at its mean time. The shortest curve sets the length."""
    length = min(len(x) for x, _ in curves)
    xs = [sum(x[i] for x, _ in curves) / len(curves) for i in range(length)]
    columns = [[y[i] for _, y in curves] for i in range(length)]
    return xs, [sum(c) / len(c) for c in columns], [min(c) for c in columns], [max(c) for c in columns]


def plot_band(axis, curves, label: str, color: str) -> None:
    """Mean line with a min-max band over seeds."""
    xs, mean, low, high = band(curves)
    axis.plot(xs, mean, label=label, color=color)
    if len(curves) > 1:
        axis.fill_between(xs, low, high, color=color, alpha=0.2, linewidth=0)


def machine() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, commit {commit.stdout.strip()}"


def write_csv(path: Path, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def run_variants(
    variants: dict[str, list[str]],
    seeds: Sequence[int],
    keys: Sequence[str],
    common_flags: Sequence[str] = (),
    config: Path = QUICKSTART,
    progress: Path | None = None,
    seed_flags=seed_overrides,
    cache: Path | None = None,
) -> tuple[list[dict], list[dict]]:
    """Every variant (name -> CLI flags) for every seed, warm start shared per seed.

    Returns per-step rows (run, seed, step, train_seconds and each of ``keys``, NaN where not logged) and one
    row per run (run, seed, wall-clock seconds). With ``progress`` (a JSONL file), each finished run is appended
    there and a rerun of an interrupted experiment skips the runs it already holds. ``seed_flags(seed)`` gives
    the seed's CLI flags (``seed_overrides``: the RL run's, the warm start's and the prompt stream's). Warm
    starts are trained into a fresh cache unless ``cache`` names one to reuse (they are keyed by every setting).
    """
    import tempfile

    done = _finished_runs(progress)
    curves = [row for run in done.values() for row in run["curves"]]
    finished = [run["finished"] for run in done.values()]
    with tempfile.TemporaryDirectory(prefix="gspo-experiment-") as scratch:
        for seed in seeds:
            for index, (name, flags) in enumerate(variants.items()):
                if (name, seed) in done:
                    continue
                overrides = [*seed_flags(seed), *common_flags, *flags]
                result = run_fit(Path(scratch) / f"seed{seed}-{index}", overrides, cache or Path(scratch) / "cache", config)
                clock = training_clock(result["steps"])
                rows = []
                for step, values in sorted(result["steps"].items()):
                    row = {"run": name, "seed": seed, "step": step, "train_seconds": round(clock[step], 3)}
                    rows.append(row | {key: values.get(key, math.nan) for key in keys})
                curves += rows
                finished.append({"run": name, "seed": seed, "seconds": round(result["seconds"], 1)})
                _record_run(progress, rows, finished[-1])
                print(finished[-1], flush=True)
    return curves, finished


def _finished_runs(progress: Path | None) -> dict[tuple[str, int], dict]:
    runs = read_progress(progress) if progress is not None else []
    return {(run["finished"]["run"], run["finished"]["seed"]): run for run in runs}


def _record_run(progress: Path | None, rows: list[dict], finished: dict) -> None:
    if progress is not None:
        append_progress(progress, {"curves": rows, "finished": finished})


def read_progress(path: Path) -> list[dict]:
    """The runs an interrupted experiment already finished: one JSON record a line (none if the file is absent)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def append_progress(path: Path, record: dict) -> None:
    """One finished run's record, so that a rerun skips it (NaN is written as JSON's NaN token, which
    ``json.loads`` reads back)."""
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")


def runs_of(curves: list[dict], name: str) -> list[list[dict]]:
    """The per-step rows of variant ``name``, one list per seed."""
    seeds = sorted({row["seed"] for row in curves if row["run"] == name})
    return [[row for row in curves if row["run"] == name and row["seed"] == seed] for seed in seeds]


def steps_of(curves: list[dict], run: dict) -> list[dict]:
    """The per-step rows of one finished run (``run`` holds its ``run`` name and ``seed``)."""
    return next(rows for rows in runs_of(curves, run["run"]) if rows[0]["seed"] == run["seed"])


def mean_of(rows: list[dict], key: str, where=lambda row: True) -> float:
    values = [row[key] for row in rows if where(row) and not math.isnan(row[key])]
    return sum(values) / len(values) if values else math.nan


def finish_axes(axes, labels: Sequence[tuple[str, str]]) -> None:
    for axis, (xlabel, ylabel) in zip(axes, labels):
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)


def grid_figure(rows: int = 2, columns: int = 2, size: tuple[float, float] = (12, 8.5)):
    """A matplotlib figure (non-interactive backend) and its axes grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, columns, figsize=size)


def save_figure(figure, title: str, path: Path) -> None:
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def plot_accuracy_and_reward(accuracy_axis, reward_axis, runs: list[list[dict]], name: str, color: str) -> None:
    """Held-out accuracy (%) at each evaluation and the training reward (moving average 50), seeds as bands."""
    evaluated = [[r for r in run if not math.isnan(r["eval/accuracy"])] for run in runs]
    plot_band(accuracy_axis, [([r["step"] for r in e], [100 * r["eval/accuracy"] for r in e]) for e in evaluated], name, color)
    rewards = [([r["step"] for r in run], smooth([r["rollout/reward_mean"] for r in run], 50)) for run in runs]
    plot_band(reward_axis, rewards, name, color)


def outcome(steps: list[dict]) -> dict:
    """Held-out accuracy at the first and last evaluation, the best one, and the mean reward of the last 200 steps."""
    evaluated = [r["eval/accuracy"] for r in steps if not math.isnan(r["eval/accuracy"])]
    return {
        "accuracy_start": evaluated[0], "accuracy_end": evaluated[-1], "accuracy_best": max(evaluated),
        "reward_last200": mean_of(steps[-200:], "rollout/reward_mean"),
    }  # fmt: skip


def summarise(curves: list[dict], finished: list[dict], means: dict) -> list[dict]:
    """One row per finished run: its ``outcome``, its training seconds, and per column of ``means`` the mean of a
    metric over the run's steps (``column: metric``, or ``column: (metric, which_rows)``)."""
    rows = []
    for run in finished:
        steps = steps_of(curves, run)
        averages = {name: mean_of(steps, *((spec,) if isinstance(spec, str) else spec)) for name, spec in means.items()}
        rows.append(run | outcome(steps) | {"train_seconds": steps[-1]["train_seconds"]} | averages)
    return rows


def print_table(rows: list[dict], columns: dict[str, str]) -> None:
    """A Markdown table: header -> format string over a row (e.g. ``"{accuracy_end:.1%}"``)."""
    print(f"\nmachine: {machine()}")
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        print("| " + " | ".join(template.format(**row) for template in columns.values()) + " |")


def parse_arguments(description: str, seeds: Sequence[int], max_steps: int, add_arguments=None):
    """``--seeds``, ``--max-steps``, ``--replot`` and ``--cache``, with the script's docstring as help;
    ``add_arguments(parser)`` adds a script's own."""
    import argparse

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    if add_arguments is not None:
        add_arguments(parser)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(seeds))
    parser.add_argument("--max-steps", type=int, default=max_steps)
    parser.add_argument(
        "--replot", action="store_true", help="recompute results.csv and the plot from the committed curves.csv"
    )
    parser.add_argument("--cache", type=Path, help="reuse the warm starts in this cache (default: train them afresh)")
    return parser.parse_args()


def _read_rows(path: Path) -> list[dict]:
    def convert(key: str, value: str):
        if key == "run":
            return value
        return int(value) if key in ("seed", "step") else float(value)

    with path.open() as handle:
        return [{key: convert(key, value) for key, value in row.items()} for row in csv.DictReader(handle)]


def run_and_report(
    here: Path,
    variants,
    seeds,
    keys,
    flags,
    summarise,
    plot,
    png: str,
    columns: dict,
    replot: bool = False,
    config: Path = QUICKSTART,
    seed_flags=seed_overrides,
    cache: Path | None = None,
) -> None:
    """Run every variant for every seed (or, with ``replot``, reuse the committed ``curves.csv``), then write
    ``curves.csv``, ``results.csv`` and the plot, and print a table."""
    if replot:
        curves = _read_rows(here / "curves.csv")
        finished = [{k: row[k] for k in ("run", "seed", "seconds")} for row in _read_rows(here / "results.csv")]
    else:
        progress = here / "progress.jsonl"
        curves, finished = run_variants(variants, seeds, keys, flags, config, progress, seed_flags, cache)
    rows = summarise(curves, finished)
    write_csv(here / "curves.csv", curves)
    write_csv(here / "results.csv", rows)
    (here / "progress.jsonl").unlink(missing_ok=True)  # complete: curves.csv now holds every run
    plot(curves, here / png)
    print_table(rows, columns)


def save_random_qwen3(directory: Path, shape: dict) -> None:
    """A random Qwen3 of ``shape`` (``Qwen3Config`` keywords; with ``num_experts``, ``Qwen3MoeConfig``'s: a
    Qwen3-MoE) in bfloat16 and a character tokenizer with a chat template, saved as a Hugging Face checkpoint for
    ``gspo_lightning.models.Pretrained`` (nothing downloaded)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_lightning.models import TinyQwen3
    from gspo_lightning.models.char_tokenizer import ASCII_ALPHABET, SIMPLE_CHAT_TEMPLATE

    torch.manual_seed(0)
    kind, config = (Qwen3MoeForCausalLM, Qwen3MoeConfig) if "num_experts" in shape else (Qwen3ForCausalLM, Qwen3Config)
    kind(config(**shape)).to(torch.bfloat16).save_pretrained(directory)
    tokenizer = TinyQwen3(alphabet=ASCII_ALPHABET, chat_template=SIMPLE_CHAT_TEMPLATE,
                          max_position_embeddings=shape["max_position_embeddings"]).load_tokenizer()  # fmt: skip
    tokenizer.save_pretrained(directory)
