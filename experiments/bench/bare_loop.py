"""The work of gspo_lightning's optimizer steps in a bare PyTorch loop: no Trainer, no callbacks, no logging.

    python experiments/bench/bare_loop.py --steps 120 --warmup-steps 8 [--policy tiny] [--output result.json]

The baseline of ``experiments/bench/overhead.py``. Everything is read from the same YAML as the Lightning run
(``configs/quickstart.yaml``): the policy loader, the prompt source and template, P, G, K, max_new_tokens, the
sampling settings, the rewards, the objective, the optimizer and its schedule, gradient clipping; what the YAML
leaves unset takes the default of the class it would configure (``GSPOModule``, ``GroupSampler``, ``PromptDataModule``). The
math is the package's own functions (``generate_responses``, ``group_advantages``, ``split_minibatches``,
``response_scores`` with the objective's gradient predicted in the LM head's forward as ``GSPOModule`` does,
``objective_loss``), so that only the orchestration around them differs. Every K-th step samples a round:
encode the P prompts, generate G responses each, mask after EOS, decode, score, group advantages, pi_old
log-probs per minibatch. Every step: log-probs, loss, backward, clip, AdamW, learning-rate schedule.

What is left out on purpose, being framework cost: per-step metrics (entropy, ratio diagnostics, rollout
statistics), the reward runner's thread and timeout, the non-finite guard, the prompt-overflow check.

Per-step time and peak memory are measured by :class:`StepWindow`, shared with the Lightning side.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gspo_lightning.cli import composed_config  # noqa: E402
from gspo_lightning.data.datamodule import PromptDataModule, PromptLoader  # noqa: E402
from gspo_lightning.data.formatting import PromptFormatter  # noqa: E402
from gspo_lightning.data.stream import PromptStream  # noqa: E402
from gspo_lightning.engines.base import SamplingSettings  # noqa: E402
from gspo_lightning.engines.hf import generate_responses  # noqa: E402
from gspo_lightning.logprobs import response_scores  # noqa: E402
from gspo_lightning.module import GSPOModule  # noqa: E402
from gspo_lightning.objectives import (  # noqa: E402
    ObjectiveSpec,
    group_advantages,
    objective_gradient,  # noqa: E402
    objective_loss,
    resolve_objective,
)
from gspo_lightning.rewards.scoring import score_completions  # noqa: E402
from gspo_lightning.rollout.minibatches import split_minibatches  # noqa: E402
from gspo_lightning.engines.base import decode_responses, response_mask_until_eos  # noqa: E402
from gspo_lightning.rollout.pipeline import encode_prompts  # noqa: E402
from gspo_lightning.sampling.sampler import GroupSampler  # noqa: E402
from gspo_lightning.rollout.types import Minibatch, PromptBatch, Rollout  # noqa: E402

QUICKSTART = ROOT / "configs/quickstart.yaml"
TINY_POLICY = {"class_path": "gspo_lightning.models.TinyQwen3"}
# The sampler's generate call gained (group_size, share_prefill) arguments: prompts go in once each and the
# responses come back G per prompt. Older trees take the repeated prompts. Detected so the loop runs on either.
_GENERATE_REPEATS = "group_size" in inspect.signature(generate_responses).parameters


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # the kernel reports kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """Make VmHWM (peak resident memory) restart from the current RSS (Linux, clear_refs value 5)."""
    Path("/proc/self/clear_refs").write_text("5")


class StepWindow:
    """Seconds per step and peak RSS over steps ``warmup_steps .. warmup_steps + steps - 1`` (0-based).

    Call :meth:`end_of_step` at the same point of every step. The window runs from the end of step
    ``warmup_steps - 1`` to the end of the last step, so it holds every part of ``steps`` whole steps
    whatever point of the step the call is made at; the peak RSS is reset when the window opens.
    """

    def __init__(self, warmup_steps: int, steps: int) -> None:
        if warmup_steps < 1 or steps < 1:
            raise ValueError(f"warmup_steps and steps must be >= 1, got {warmup_steps} and {steps}")
        self.opens, self.closes, self.steps = warmup_steps - 1, warmup_steps + steps - 1, steps
        self.started: float | None = None
        self.result: dict[str, float] = {}

    def end_of_step(self, index: int) -> None:
        if index == self.opens:
            self.result["peak_before_mib"] = _status_mib("VmHWM")
            self.result["rss_at_open_mib"] = _status_mib("VmRSS")
            reset_peak_rss()
            self.started = time.perf_counter()
        elif index == self.closes and self.started is not None:
            seconds = time.perf_counter() - self.started
            window_peak = _status_mib("VmHWM")
            self.result |= {
                "seconds_per_step": seconds / self.steps,
                "window_peak_mib": window_peak,
                "process_peak_mib": max(window_peak, self.result["peak_before_mib"]),
                "threads": torch.get_num_threads(),
            }


def with_defaults(cls: type, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` over the defaults of ``cls``'s constructor: every value LightningCLI would pass it."""
    parameters = inspect.signature(cls).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not p.empty} | given


def instantiate(spec: Any, *positional: Any) -> Any:
    """A ``{class_path, init_args}`` spec as LightningCLI builds it (nested specs too; ``positional`` first, as for
    an optimizer's parameters); anything else as is."""
    if not (isinstance(spec, dict) and "class_path" in spec):
        return spec
    module, name = spec["class_path"].rsplit(".", 1)
    arguments = {key: instantiate(value) for key, value in (spec.get("init_args") or {}).items()}
    return getattr(importlib.import_module(module), name)(*positional, **arguments)


@dataclass
class BareRun:
    """Everything one training run holds, built from the YAML without Lightning."""

    policy: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    batches: Any
    settings: SamplingSettings
    rewards: list[Any]
    weights: list[float]
    sampler: dict[str, Any]
    objective: ObjectiveSpec
    eps: tuple[float, float]
    clip: float
    chunk_size: int


def build(config: dict[str, Any], policy_spec: dict[str, Any] | None = None) -> BareRun:
    """The policy, optimizer, prompt stream and sampling settings of ``config`` (a LightningCLI YAML)."""
    # Read from the classes' signatures, so a default changed in the package changes here too.
    model = with_defaults(GSPOModule, config["model"]["init_args"])
    sampler = with_defaults(GroupSampler, config["sampler"])
    loader = instantiate(policy_spec or model["policy"])
    tokenizer = loader.load_tokenizer()
    # Eval mode for good, as GSPOModule: dropout off, so pi_old and pi_theta are the same function.
    policy = loader.load_model(tokenizer).eval()
    optimizer = instantiate(config["optimizer"], policy.parameters())
    scheduler = instantiate(config["lr_scheduler"], optimizer) if config.get("lr_scheduler") else None
    objective = resolve_objective(model["objective"])
    low, high = objective.objective.clip_range
    settings = SamplingSettings(model["max_new_tokens"], model["temperature"], sampler["top_p"], sampler["top_k"])
    rewards = [instantiate(spec) for spec in sampler["rewards"]]
    return BareRun(
        policy=policy,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        batches=prompt_batches(config["data"]["init_args"], sampler["num_minibatches"]),
        settings=settings,
        rewards=rewards,
        weights=sampler["reward_weights"] or [1.0] * len(rewards),
        sampler=sampler,
        objective=objective,
        eps=(model["eps_low"] or low, model["eps_high"] or high),
        clip=config["trainer"].get("gradient_clip_val") or 0.0,
        chunk_size=model["logprob_chunk_size"],
    )


def prompt_batches(data: dict[str, Any], num_minibatches: int) -> PromptLoader:
    """The training stream PromptDataModule serves (each round K times), through the same plain DataLoader."""
    data = with_defaults(PromptDataModule, data)
    train = instantiate(data["source"]).load()["train"]
    formatter = PromptFormatter(data["prompt_template"], data["chat_template"], data["system_prompt"])
    stream = PromptStream(
        train,
        formatter,
        prompts_per_rollout=data["prompts_per_rollout"],
        minibatches_per_rollout=num_minibatches,
        seed=data["seed"],
        columns=list(train.column_names),
    )
    return PromptLoader(stream)


def _shares_prefill(sampler: dict) -> bool:
    """The ``hf`` engine's share_prompt_prefill as the config sets it (default on)."""
    engine = sampler.get("engine", "hf")
    return True if isinstance(engine, str) else engine.get("init_args", {}).get("share_prompt_prefill", True)


def sample_round(run: BareRun, batch: PromptBatch) -> tuple[list[Minibatch], Rollout]:
    """One rollout round: G responses per prompt, rewards, group advantages, K minibatches with pi_old."""
    group = run.sampler["group_size"]
    prompt_ids, prompt_mask = encode_prompts(run.tokenizer, batch.prompts, "cpu")  # [P, Lp] x2
    repeated_ids = prompt_ids.repeat_interleave(group, dim=0)  # [N, Lp]
    repeated_mask = prompt_mask.repeat_interleave(group, dim=0)  # [N, Lp]
    if _GENERATE_REPEATS:
        args = (prompt_ids, prompt_mask, run.settings, False, group, _shares_prefill(run.sampler))
    else:
        args = (repeated_ids, repeated_mask, run.settings)
    response_ids = generate_responses(run.policy, run.tokenizer, *args)  # [N, R]
    response_mask, truncated = response_mask_until_eos(response_ids, run.tokenizer.eos_token_id)  # [N, R], [N]
    completions = decode_responses(run.tokenizer, response_ids, response_mask)
    columns = {name: [v for v in values for _ in range(group)] for name, values in batch.columns.items()}
    prompts = [prompt for prompt in batch.prompts for _ in range(group)]
    rewards, _ = score_completions(run.rewards, run.weights, prompts, completions, columns)  # [N]
    advantages = group_advantages(rewards, group, run.sampler["advantage_scale"])  # [N]
    rollout = Rollout(repeated_ids, repeated_mask, response_ids, response_mask, rewards, advantages, truncated)
    minibatches = split_minibatches(
        rollout, run.sampler["num_minibatches"], run.policy, run.settings.temperature, chunk_size=run.chunk_size
    )
    return minibatches, rollout


def train_step(run: BareRun, minibatch: Minibatch) -> torch.Tensor:
    """One optimizer step on one minibatch, as Lightning's automatic optimisation runs it."""
    scores = response_scores(
        run.policy,
        minibatch.input_ids,
        minibatch.attention_mask,
        minibatch.response_ids.shape[1],
        run.settings.temperature,
        run.chunk_size,
        predict_upstream=objective_gradient(
            run.objective, minibatch.old_logprobs, minibatch.advantages, minibatch.response_mask, *run.eps
        ),
    )
    loss, _ = objective_loss(
        run.objective,
        scores.logprobs,
        minibatch.old_logprobs,
        minibatch.advantages,
        minibatch.response_mask,
        *run.eps,
    )
    loss.backward()
    if run.clip:
        torch.nn.utils.clip_grad_norm_(run.policy.parameters(), run.clip)
    run.optimizer.step()
    if run.scheduler is not None:
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def train(run: BareRun, warmup_steps: int, steps: int) -> dict[str, Any]:
    """``warmup_steps + steps`` optimizer steps; the window's timings and what the timed rounds sampled."""
    window = StepWindow(warmup_steps, steps)
    minibatches: list[Minibatch] = []
    losses, rounds = [], []
    for index, batch in zip(range(warmup_steps + steps), run.batches):
        if batch.minibatch_index == 0:
            minibatches, rollout = sample_round(run, batch)
            rounds.append((index, rollout.rewards, rollout.response_mask.sum(-1)))
        losses.append(train_step(run, minibatches[batch.minibatch_index]))
        window.end_of_step(index)
    timed = [(rewards, lengths) for index, rewards, lengths in rounds if index >= warmup_steps]
    return window.result | {
        "losses": [float(loss) for loss in losses],
        "reward_mean": statistics.fmean(float(rewards.mean()) for rewards, _ in timed),
        "response_len_mean": statistics.fmean(float(lengths.float().mean()) for _, lengths in timed),
        "nonzero_advantage_rounds": sum(bool(rewards.std() > 0) for rewards, _ in timed),
    }


def seed_everything(seed: int) -> None:
    """The generators Lightning's ``seed_everything`` seeds, without Lightning."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--config", type=Path, default=QUICKSTART)
    parser.add_argument("--policy", choices=("config", "tiny"), default="config", help="tiny: random TinyQwen3")
    parser.add_argument("--steps", type=int, default=120, help="timed optimizer steps")
    parser.add_argument("--warmup-steps", type=int, default=8, help="untimed optimizer steps before them")
    parser.add_argument("--output", type=Path, help="write the result as JSON here (default: print it)")
    parser.add_argument("--prepare", action="store_true", help="only build the policy (fills the warm-start cache)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = composed_config(args.config)  # base.yaml under it, as the command line reads it
    seed_everything(config.get("seed_everything") or 0)
    run = build(config, TINY_POLICY if args.policy == "tiny" else None)
    if args.prepare:
        return
    result = {"side": "bare"} | train(run, args.warmup_steps, args.steps)
    text = json.dumps(result)
    if args.output:
        args.output.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
