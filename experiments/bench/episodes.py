"""The cost of turns: single-turn responses against 2- and 4-turn episodes with the same number of policy tokens.

    python experiments/bench/episodes.py            # CPU, both engines, about 10 minutes on 2 cores

P x G = 8 x 4 episodes per round, each with T = 192 policy tokens in total: one turn of 192, two of 96 or four of
48, every observation 24 tokens (an environment that answers each turn with a fixed message). Each turn is
exactly its share of tokens long (EOS held off, then written as the turn's last token), so every setting
generates the same tokens. Through gspo_lightning's own classes (``run_round`` with ``sampler.episodes``, then K =
4 ``GSPOModule.training_step``s with backward and AdamW) on a random-weight Qwen3 (hidden 256, 4 layers, 4 heads,
the compact tool chat template), for each engine:

- engine tokens/s: policy tokens / seconds of the episode loop (sampling, environment, template tokens);
- seconds per optimizer step: (one round + K training steps) / K, after a warm-up round.

The median of 3 rounds, each (engine, turns) in a fresh process. What a turn should cost is the prefill of its
observation: vLLM's prefix cache holds the episode's earlier tokens (every continuation is a request on the
episode's own ids); ``generate`` has no cache across calls and prefills the whole history again each turn.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gspo_lightning.episodes import Environment, Step  # noqa: E402

POLICY_TOKENS, OBSERVATION, PROMPTS, GROUP, K = 192, 24, 8, 4, 4


def _fixed_turn_engine(name: str):
    """The engine, every turn exactly ``max_new_tokens`` long and ending with EOS."""
    from experiments.bench.engines import fixed_length_classes
    from gspo_lightning.engines import HFEngine

    FixedLengthSettings, FixedLengthVLLM = fixed_length_classes()
    base = HFEngine if name == "hf" else FixedLengthVLLM

    class EndsTurnAtBudget(base):
        def sample(self, policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, *rest, **keywords):
            fixed = FixedLengthSettings(settings.max_new_tokens, settings.temperature)
            samples = super().sample(policy, tokenizer, prompt_ids, prompt_mask, fixed, group_size, *rest, **keywords)
            samples.response_ids[:, settings.max_new_tokens - 1] = tokenizer.eos_token_id  # the turn ends here
            samples.ended[:] = True
            return samples

    return EndsTurnAtBudget()


def worker(args: dict) -> dict:
    """One (engine, turns) setting in this process."""
    from types import SimpleNamespace

    import torch

    from gspo_lightning import GSPOModule
    from gspo_lightning.episodes import EpisodeSettings
    from gspo_lightning.models import TinyQwen3
    from gspo_lightning.models.char_tokenizer import ASCII_ALPHABET
    from gspo_lightning.rollout.pipeline import Scoring
    from gspo_lightning.rollout.round import RoundModel, RoundSettings, run_round
    from gspo_lightning.rollout.types import PromptBatch
    from tests.fault_helpers import length_reward

    torch.manual_seed(0)
    turns = args["turns"]
    loader = TinyQwen3(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024,
                       max_position_embeddings=1024, alphabet=ASCII_ALPHABET, chat_template="tools")  # fmt: skip
    module = GSPOModule(loader, max_new_tokens=POLICY_TOKENS // turns, log_entropy=False)
    module.configure_model()
    optimizer = torch.optim.AdamW(module.policy.parameters(), lr=1e-5)
    engine = _fixed_turn_engine(args["engine"])
    trainer = SimpleNamespace(world_size=1, global_rank=0, local_rank=0, global_step=0, precision="32-true", strategy=None)
    engine.setup(trainer, module)
    episodes = EpisodeSettings(environment=lambda: FixedReplies(turns), max_turns=turns)
    settings = RoundSettings(group_size=GROUP, num_minibatches=K, scoring=Scoring([length_reward], [1.0]),
                             episodes=episodes)  # fmt: skip
    model = RoundModel(module.policy, module.tokenizer, max_new_tokens=POLICY_TOKENS // turns)
    prompts = [[{"role": "user", "content": f"question {i:02d} " + "x" * 20}] for i in range(PROMPTS)]
    rounds = []
    for repetition in range(4):  # the first warms up
        batch = PromptBatch(prompts, {"answer": ["1"] * PROMPTS})
        started = time.perf_counter()
        with torch.no_grad():
            result = run_round(engine, model, settings, batch, seed=repetition)
        sampled = result.seconds["generate_s"]
        for minibatch in result.minibatches:
            module.log = lambda *a, **k: None
            loss = module.training_step(PromptBatch(prompts, {}, minibatch=minibatch), 0)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        total = time.perf_counter() - started
        counts = result.rollout.episodes
        rounds.append({"sample_s": sampled, "step_s": total / K, "policy_tokens": int(counts.policy_tokens.sum()),
                       "context_tokens": int(counts.context_tokens.sum()), "turns": float(counts.turns.float().mean())})  # fmt: skip
    engine.teardown()
    return {"rounds": rounds[1:]}


class FixedReplies(Environment):
    """Answers each turn with the same message (24 tokens with its template); done after ``turns`` turns."""

    def __init__(self, turns: int) -> None:
        self.turns, self.taken = turns, 0

    def reset(self, row):
        return row["prompt"]

    def step(self, turn):
        self.taken += 1
        if self.taken >= self.turns:
            return Step(done=True)
        return Step(observation=[{"role": "user", "content": "o" * (OBSERVATION - 3)}])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; P x G = {PROMPTS} x {GROUP}, "
          f"{POLICY_TOKENS} policy tokens per episode, {OBSERVATION}-token observations, K = {K}\n")  # fmt: skip
    print("| engine | turns | policy tokens / round | context tokens / round | engine tokens/s | sampling s / round "
          "| s / optimizer step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for engine in args.engines:
        for turns in args.turns:
            setting = json.dumps({"engine": engine, "turns": turns})
            environment = dict(os.environ, PYTHONPATH=str(ROOT))
            done = subprocess.run([sys.executable, __file__, "--worker", setting], capture_output=True, text=True,
                                  env=environment)  # fmt: skip
            if done.returncode != 0:
                print(f"| {engine} | {turns} | failed: {done.stderr.strip().splitlines()[-1]} |")
                continue
            rounds = json.loads(done.stdout.strip().splitlines()[-1])["rounds"]
            sample_s = statistics.median(r["sample_s"] for r in rounds)
            step_s = statistics.median(r["step_s"] for r in rounds)
            policy, context = rounds[0]["policy_tokens"], rounds[0]["context_tokens"]
            print(f"| {engine} | {turns} | {policy} | {context} | {policy / sample_s:,.0f} | {sample_s:.2f} | "
                  f"{step_s:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
