"""The vLLM engines on one GPU: colocated with sleep mode against a vLLM server on the same GPU, weights through
vLLM's transfer engines; random-weight Qwen3-0.6B shape, bf16, FSDP2 on one device.

    python experiments/gpu_engines/run.py            # one GPU, under 8 minutes; figures to output.txt, results.csv
    python experiments/gpu_engines/run.py --check    # no GPU: every variant's command parses (a fast test runs it)

A random Qwen3 of Qwen3-0.6B's shape (28 layers, width 1,024, 16 heads, 8 KV heads, Qwen3's vocabulary of 151,936,
tied embeddings; no weights can be downloaded) with a character tokenizer is saved once, then trained through the
CLI (``configs/quickstart.yaml``'s task: 3-digit additions, P x G = 32 x 8, K = 4, responses of up to 64 tokens)
for ``--steps`` optimizer steps on ``DecoderLayerFSDP2`` (one device), ``bf16-mixed``, ``old_logprobs:
recompute``, once per engine, each in a fresh process:

- ``vllm_sleep``: the colocated ``vllm`` engine with ``sleep_mode: true`` (weights offloaded and the KV cache
  dropped while training runs), weights loaded in place;
- ``server_ipc``: ``vllm_server`` started by the engine on the same GPU (``devices: ["0"]``), weights through
  vLLM's CUDA IPC engine (``weight_transfer: ipc``: no copy through the host);
- ``server_nccl``: the same with vLLM's NCCL broadcast (``weight_transfer: nccl``). NCCL refuses two ranks on one
  GPU, so on one GPU this is expected to stop at the rendezvous; its first error line is recorded, and on a
  machine with two GPUs ``--server-gpu 1`` measures it.

Recorded per engine: seconds per optimizer step (after the first round), sampling seconds per round, seconds and
bytes per weight sync (``engine/sync_s``, ``engine/sync_bytes``; the colocated engine's in-place load is not
timed apart), the largest ``mismatch/kl`` (engine log-probs against the trainer's recomputed pi_old), and the
GPU's peak memory in use by all processes (``nvidia-smi``, polled). Until a GPU has run it the figures are
unmeasured (``experiments/README.md`` says so).
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "experiments"))
from common import save_random_qwen3  # noqa: E402

SHAPE = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
             intermediate_size=3072, head_dim=128, max_position_embeddings=512, tie_word_embeddings=True)  # fmt: skip
TINY_SHAPE = dict(SHAPE, vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, intermediate_size=128, head_dim=32)  # fmt: skip


def engines(server_gpu: str) -> dict[str, dict]:
    server = {"class_path": "gspo_lightning.engines.VLLMServerEngine",
              "init_args": {"devices": [server_gpu], "port": 8261, "gpu_memory_utilization": 0.3}}  # fmt: skip
    return {
        "vllm_sleep": {"class_path": "gspo_lightning.engines.VLLMEngine",
                       "init_args": {"sleep_mode": True, "gpu_memory_utilization": 0.3}},
        "server_ipc": {**server, "init_args": {**server["init_args"], "weight_transfer": "ipc"}},
        "server_nccl": {**server, "init_args": {**server["init_args"], "weight_transfer": "nccl"}},
    }  # fmt: skip


def command(engine: dict, model: Path, steps: int, accelerator: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The CLI run of one engine (``extra``: more overrides)."""
    strategy = "gspo_lightning.strategies.DecoderLayerFSDP2" if accelerator == "gpu" else "auto"
    return [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(ROOT / "configs/quickstart.yaml"),
            f"--trainer.accelerator={accelerator}", "--trainer.devices=1", f"--trainer.max_steps={steps}",
            f"--trainer.strategy={strategy}", "--trainer.enable_progress_bar=false",
            "--trainer.precision=" + ("bf16-mixed" if accelerator == "gpu" else "32-true"),
            "--model.init_args.policy=gspo_lightning.models.Pretrained",
            f"--model.init_args.policy.init_args.name_or_path={model}",
            "--model.init_args.max_new_tokens=64", f"--lr_scheduler.init_args.total_steps={steps}",
            "--sampler.old_logprobs=recompute", f"--sampler.engine={json.dumps(engine)}",
            "--evaluation.every_n_steps=100000", *extra]  # fmt: skip


class PeakMemory(threading.Thread):
    """The GPU's largest memory in use (MiB, every process) while it runs, from ``nvidia-smi``."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = 0, True

    def run(self) -> None:
        while self.running:
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout  # fmt: skip
                self.peak = max([self.peak, *(int(v) for v in out.split() if v.isdigit())])
            except (OSError, subprocess.SubprocessError):
                pass
            time.sleep(0.5)


def run_one(name: str, engine: dict, model: Path, steps: int, work: Path, timeout: int,
            extra: tuple[str, ...] = ()) -> dict:  # fmt: skip
    workdir = work / name
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    memory = PeakMemory()
    memory.start()
    started = time.perf_counter()
    try:
        result = subprocess.run(command(engine, model, steps, "gpu", extra), cwd=workdir, capture_output=True,
                                text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=timeout)  # fmt: skip
        error = None if result.returncode == 0 else _first_error(result.stderr)
    except subprocess.TimeoutExpired:
        error = f"did not finish within {timeout} s"
    memory.running = False
    row = {"engine": name, "wall_s": round(time.perf_counter() - started, 1), "gpu_peak_mib": memory.peak,
           "error": error or ""}  # fmt: skip
    metrics = list(workdir.glob("runs/*/version_0/metrics.csv"))
    if error is None and metrics:
        row.update(_figures(list(csv.DictReader(metrics[0].open()))))
    return row


def _first_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("error:") or "Error" in line]
    return (said[-1] if said else (lines[-1] if lines else "no output"))[:300]


def _figures(rows: list[dict]) -> dict:
    def values(name: str) -> list[float]:
        return [float(r[name]) for r in rows if r.get(name) and int(r["step"]) >= 4]  # after the first round

    def mean(name: str) -> float | str:
        found = values(name)
        return round(sum(found) / len(found), 4) if found else ""

    syncs = sum(values("engine/syncs"))
    return {"step_s": mean("time/train_s"), "generate_s_per_round": mean("time/generate_s"),
            "sync_s": round(sum(values("engine/sync_s")) / syncs, 4) if syncs else "",
            "sync_bytes": int(max(values("engine/sync_bytes"))) if syncs else "",
            "mismatch_kl_max": max(values("mismatch/kl") or [float("nan")]),
            **({"route_change_mean": mean("moe/rollout_vs_old_change_frac")}
               if values("moe/rollout_vs_old_change_frac") else {})}  # fmt: skip


def check(work: Path, variants: dict[str, tuple[dict, tuple[str, ...]]] | None = None,
          shape: dict = TINY_SHAPE) -> int:  # fmt: skip
    """Every variant's command (name: engine and extra overrides; these engines' by default), on a tiny model of
    ``shape``, parsed and type-checked by the CLI (``--print_config``: the engines' settings against their
    signatures); nothing is built, so no GPU is needed."""
    variants = variants or {name: (engine, ()) for name, engine in engines("0").items()}
    model = work / "tiny"
    save_random_qwen3(model, shape)
    failed = 0
    for name, (engine, extra) in variants.items():
        result = subprocess.run([*command(engine, model, 8, "gpu", extra), "--print_config"], capture_output=True,
                                text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)  # fmt: skip
        status = "parses" if result.returncode == 0 else f"fails: {_first_error(result.stderr)}"
        failed += result.returncode != 0
        print(f"{name}: {status}", flush=True)
    shutil.rmtree(model, ignore_errors=True)
    return 1 if failed else 0


def write_results(here: Path, rows: list[dict], command_line: str) -> None:
    """``results.csv`` and ``output.txt`` (the command, the GPU and the machine, then a row per line) in ``here``."""
    for row in rows:
        print(row, flush=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with (here / "results.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip()  # fmt: skip
    header = f"# {command_line}  ({gpu}, {platform.machine()}, {os.cpu_count()} cores)"
    (here / "output.txt").write_text(header + "\n" + "\n".join(json.dumps(row) for row in rows) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="parse every variant's command; no GPU needed")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--server-gpu", default="0", help="CUDA_VISIBLE_DEVICES of the server (the trainer's: 0)")
    parser.add_argument("--timeout", type=int, default=150, help="seconds per engine")
    parser.add_argument("--engines", nargs="+", default=list(engines("0")))
    args = parser.parse_args()
    work = HERE / "work"
    work.mkdir(parents=True, exist_ok=True)
    if args.check:
        return check(work)
    model = work / "qwen3_0.6b_shape"
    save_random_qwen3(model, SHAPE)
    rows = [run_one(name, engines(args.server_gpu)[name], model, args.steps, work, args.timeout)
            for name in args.engines]  # fmt: skip
    write_results(HERE, rows, f"python experiments/gpu_engines/run.py --steps {args.steps} --server-gpu "
                              f"{args.server_gpu}")  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(not row["error"] for row in rows if row["engine"] != "server_nccl") else 1


if __name__ == "__main__":
    sys.exit(main())
