"""Per-step figures of three short quick-start runs, compared between two checkouts: a restructure that must not
change the numbers (issue 24's rollout pipeline) is checked with it.

    python experiments/bitwise/run.py --before /path/to/old/checkout [--after .]

Each checkout runs, with this interpreter, 24 optimizer steps of ``configs/quickstart.yaml`` four ways: as is;
with dynamic sampling, truncated responses masked and a KL penalty in the reward; with pi_old from the engine and
GSPO-token; sampled one round ahead (``sampler.asynchronous`` fixed lag 1, TIS); and 24 steps of the multi-turn
tool demo (``configs/tool_calculator.yaml``). Every logged column but the ``time/*`` ones must be equal as written
(bitwise), row by row.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
from pathlib import Path

QUICKSTART, TOOLS = "configs/quickstart.yaml", "configs/tool_calculator.yaml"
VARIANTS = {
    "plain": (QUICKSTART, []),
    "dynamic_kl": (QUICKSTART, ["--sampler.dynamic_sampling=true", "--sampler.mask_truncated=true",
                                "--model.init_args.objective={name: gspo, kl_coef: 0.05, kl_in: reward}"]),
    "engine_logprobs": (QUICKSTART, ["--sampler.old_logprobs=engine", "--model.init_args.objective={name: gspo_token}"]),
    "fixed_lag": (QUICKSTART, ["--sampler.asynchronous.mode=fixed_lag", "--sampler.asynchronous.lag=1",
                               "--model.init_args.rollout_correction.mode=tis"]),
    "episodes": (TOOLS, []),
}  # fmt: skip


def run(checkout: Path, out: Path) -> dict[str, list[dict[str, str]]]:
    rows = {}
    for name, (config, extra) in VARIANTS.items():
        command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", config,
                   "--trainer.max_steps=24", "--trainer.enable_progress_bar=false", "--evaluation.every_n_steps=12",
                   f"--trainer.logger.init_args.save_dir={out}", f"--trainer.logger.init_args.name={name}", *extra]  # fmt: skip
        subprocess.run(command, cwd=checkout, check=True, capture_output=True, env=None)
        with open(out / name / "version_0" / "metrics.csv") as handle:
            rows[name] = list(csv.DictReader(handle))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, default=Path("."))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as before_out, tempfile.TemporaryDirectory() as after_out:
        before, after = run(args.before.resolve(), Path(before_out)), run(args.after.resolve(), Path(after_out))
    same = True
    for name in VARIANTS:
        old, new = before[name], after[name]
        columns = [c for c in old[0] if not c.startswith("time/")]
        differing = sorted({c for a, b in zip(old, new) for c in columns if a.get(c) != b.get(c)})
        if len(old) != len(new) or set(old[0]) != set(new[0]):
            differing.append("(rows or columns)")
        same &= not differing
        print(f"{name}: {len(old)} rows, {len(columns)} columns compared; differing: {differing or 'none'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
