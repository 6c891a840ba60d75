"""The quick start over a vLLM server against the same run on the colocated vLLM engine, 500 steps.

    python experiments/server_engine/run.py                  # both engines, seed 0, about 40 minutes on 2 cores
    python experiments/server_engine/run.py --engines vllm_server --seeds 0 1

``python -m gspo_lightning fit -c configs/quickstart.yaml`` for 500 steps (its held-out evaluation at 0, 250 and
500), sampling with

- ``vllm_server``: a vLLM server the engine starts on core 1 (``cpu_cores: ["1"]``), the trainer's process on
  core 0 (``taskset -c 0``), the weights reloaded by the server through its RL endpoints after every round;
- ``vllm``: the colocated engine in the trainer's process (both cores), the weights loaded in place.

Same seeds, same warm start (trained once per seed into a shared cache before anything runs). Recorded per run:
held-out greedy accuracy at steps 0 and 500 and the gain (against the quick-start guard's floor,
``tests/test_quickstart.py``: +12 points), the training reward's gain (steps 400-499 against 0-99; floor +0.07),
the largest ``mismatch/kl`` of any step (the engine's log-probs against the trainer's pi_old, recomputed, of the
same samples) and, for the server, the mean seconds per weight sync and bytes per sync. Results: ``results.csv``
beside this file, ``output.txt`` (the summary); exits non-zero when a floor is missed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from tests.test_quickstart import MIN_GAIN, MIN_REWARD_GAIN  # noqa: E402 - the guard's floors, stated once

STEPS = 500
ENGINES = {
    "vllm_server": (["taskset", "-c", "0"], {"class_path": "gspo_lightning.engines.VLLMServerEngine",
                                             "init_args": {"cpu_cores": ["1"], "port": 8241}}),
    "vllm": ([], {"class_path": "gspo_lightning.engines.VLLMEngine"}),
}  # fmt: skip
MAX_MISMATCH_KL = 1e-6


def _environment(cache: Path) -> dict[str, str]:
    return dict(os.environ, GSPO_LIGHTNING_CACHE=str(cache), PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1")


def _run(engine: str, seed: int, work: Path, cache: Path) -> dict:
    workdir = work / f"{engine}_{seed}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    prefix, spec = ENGINES[engine]
    command = [*prefix, sys.executable, "-m", "gspo_lightning", "fit", "-c", str(ROOT / "configs/quickstart.yaml"),
               f"--trainer.max_steps={STEPS}", "--trainer.enable_progress_bar=false",
               f"--sampler.engine={json.dumps(spec)}", f"--seed_everything={seed}",
               f"--model.init_args.policy.init_args.seed={seed}", f"--data.init_args.seed={seed}"]  # fmt: skip
    result = subprocess.run(command, cwd=workdir, env=_environment(cache), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{engine} seed {seed} failed:\n{result.stderr[-4000:]}")
    rows = list(csv.DictReader(next(workdir.glob("runs/*/version_0/metrics.csv")).open()))
    return _summary(engine, seed, rows)


def _values(rows: list[dict], name: str) -> dict[int, float]:
    return {int(r["step"]): float(r[name]) for r in rows if r.get(name)}


def _summary(engine: str, seed: int, rows: list[dict]) -> dict:
    accuracy, reward = _values(rows, "eval/accuracy"), _values(rows, "rollout/reward_mean")
    late = [reward[s] for s in range(400, 500)]
    early = [reward[s] for s in range(100)]
    syncs = sum(_values(rows, "engine/syncs").values())
    return {
        "engine": engine, "seed": seed, "accuracy_0": accuracy[0], "accuracy_500": accuracy[STEPS],
        "accuracy_gain": round(accuracy[STEPS] - accuracy[0], 4),
        "reward_gain": round(sum(late) / len(late) - sum(early) / len(early), 4),
        "mismatch_kl_max": max(_values(rows, "mismatch/kl").values()),
        "syncs": int(syncs),
        "sync_s_mean": round(sum(_values(rows, "engine/sync_s").values()) / syncs, 4) if syncs else "",
        "sync_bytes": int(max(_values(rows, "engine/sync_bytes").values())) if syncs else "",
        "train_s_per_step": round(sum(_values(rows, "time/train_s").values()) / STEPS, 4),
        "generate_s_per_round": round(sum(_values(rows, "time/generate_s").values()) / (STEPS / 4), 4),
    }  # fmt: skip


def _missed(row: dict) -> list[str]:
    missed = []
    if row["accuracy_gain"] < MIN_GAIN:
        missed.append(f"held-out gain {row['accuracy_gain']:+.3f} < {MIN_GAIN}")
    if row["reward_gain"] < MIN_REWARD_GAIN:
        missed.append(f"reward gain {row['reward_gain']:+.3f} < {MIN_REWARD_GAIN}")
    if row["mismatch_kl_max"] >= MAX_MISMATCH_KL:
        missed.append(f"mismatch KL {row['mismatch_kl_max']:.2e} >= {MAX_MISMATCH_KL}")
    return missed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    work = HERE / "work"
    cache = work / "cache"
    rows = []
    for seed in args.seeds:
        for engine in args.engines:
            rows.append(_run(engine, seed, work, cache))
            print(rows[-1], flush=True)
    with (HERE / "results.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# python experiments/server_engine/run.py --engines {' '.join(args.engines)} --seeds "
             f"{' '.join(map(str, args.seeds))}  ({platform.machine()}, {os.cpu_count()} cores)"]  # fmt: skip
    failed = False
    for row in rows:
        missed = _missed(row)
        failed |= bool(missed)
        sync = f", {row['syncs']} syncs of {row['sync_s_mean']} s" if row["syncs"] else ""
        lines.append(f"{row['engine']:>11} seed {row['seed']}: held-out {100 * row['accuracy_0']:.1f}% -> "
                     f"{100 * row['accuracy_500']:.1f}% ({100 * row['accuracy_gain']:+.1f} points), reward "
                     f"{row['reward_gain']:+.3f}, mismatch KL max {row['mismatch_kl_max']:.1e}{sync}: "
                     + ("; ".join(missed) if missed else "floors met"))  # fmt: skip
    (HERE / "output.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
