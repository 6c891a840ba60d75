"""Rollout Routing Replay with vLLM on one GPU: vLLM's routed experts (``enable_return_routed_experts``) replayed in
the trainer's forwards; random-weight Qwen3-MoE, bf16, FSDP2 on one device.

    python experiments/gpu_moe_r3/run.py            # one GPU, under 8 minutes; figures to output.txt, results.csv
    python experiments/gpu_moe_r3/run.py --check    # no GPU: every variant's command parses (a fast test runs it)

vLLM 0.32 reports routed experts only from its V2 model runner, on GPUs; on CPUs the engines refuse R3 at setup
and their layout is tested against stand-ins (``tests/engines/test_vllm_routes.py``). This script is the check on
the real thing: a random Qwen3-MoE (16 layers of 32 experts, top-4, width 1,024, Qwen3's vocabulary) trained
through the CLI as ``experiments/gpu_engines`` trains its dense model, once per variant in a fresh process:

- ``vllm_off``: the colocated ``vllm`` engine with sleep mode, ``routing_replay: off``: the mismatch KL without
  replay (the engine records no experts then);
- ``vllm_r3``: the same with ``routing_replay: rollout`` (every route checked against its sequence on arrival;
  ``moe/rollout_vs_old_change_frac`` says how many of vLLM's experts the trainer's pi_old would have replaced);
- ``server_r3``: ``vllm_server`` on the same GPU (``weight_transfer: ipc``), R3, routes from the server's answers.

Recorded per variant: seconds per step, sampling seconds per round, the largest mismatch KL (engine log-probs
against the trainer's pi_old: R3 should lower it, removing the routing part), the mean routing change, and the
GPU's peak memory. Until a GPU has run it the figures are unmeasured (``experiments/README.md`` says so).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "experiments"))
import common  # noqa: E402

gpu_engines = common.load_script(ROOT / "experiments/gpu_engines/run.py")

SHAPE = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
             head_dim=128, intermediate_size=3072, moe_intermediate_size=384, num_experts=32, num_experts_per_tok=4,
             norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=512,
             tie_word_embeddings=True)  # fmt: skip
TINY_SHAPE = dict(SHAPE, vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2)  # fmt: skip


def variants() -> dict[str, tuple[dict, tuple[str, ...]]]:
    """Each variant's engine and overrides."""
    colocated = gpu_engines.engines("0")["vllm_sleep"]
    server = gpu_engines.engines("0")["server_ipc"]
    replay = "--model.init_args.routing_replay="
    return {"vllm_off": (colocated, (replay + "off",)), "vllm_r3": (colocated, (replay + "rollout",)),
            "server_r3": (server, (replay + "rollout",))}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="parse every variant's command; no GPU needed")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--timeout", type=int, default=150, help="seconds per variant")
    parser.add_argument("--variants", nargs="+", default=list(variants()))
    args = parser.parse_args()
    work = HERE / "work"
    work.mkdir(parents=True, exist_ok=True)
    if args.check:
        return gpu_engines.check(work, variants(), TINY_SHAPE)
    model = work / "qwen3_moe"
    common.save_random_qwen3(model, SHAPE)
    chosen = variants()
    rows = []
    for name in args.variants:
        engine, extra = chosen[name]
        rows.append(gpu_engines.run_one(name, engine, model, args.steps, work, args.timeout, extra))
    gpu_engines.write_results(HERE, rows, f"python experiments/gpu_moe_r3/run.py --steps {args.steps}")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(not row["error"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
