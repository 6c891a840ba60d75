"""Checks of ``VLLMProcessEngine`` on this CPU, run in a process of their own by ``test_vllm_process.py``."""

from __future__ import annotations

import argparse
import gc
import json
import os
from types import SimpleNamespace

import lightning.pytorch as pl
import torch
from safetensors.torch import load_file, save_file

from gspo_lightning.engines import VLLMProcessEngine
from gspo_lightning.engines.base import SamplingSettings
from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.models import TinyQwen3
from tests.conftest import TINY


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    torch.manual_seed(0)
    loader = TinyQwen3(**{**TINY, "hidden_size": 64, "intermediate_size": 128})  # head size 32: a CPU kernel exists
    tokenizer = loader.load_tokenizer()
    policy = loader.load_model(tokenizer).eval()
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False)  # fmt: skip
    module = SimpleNamespace(policy=policy, tokenizer=tokenizer, device=torch.device("cpu"), routing_replay="off")
    engine = VLLMProcessEngine(seed=0)
    results: dict = {}
    paths: list[str] = []
    try:
        engine.setup(trainer, module)  # loads the first snapshot and checks it
        first = engine.loaded
        results["gap_initial"] = float((engine.engine_probe_logprobs() - first.probe_logprobs).abs().max())
        with torch.no_grad():
            for parameter in policy.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
        second = engine.snapshot_weights(trainer, module)
        results["probe_moved"] = float((second.probe_logprobs - first.probe_logprobs).abs().max())
        engine.load_snapshot(second)
        results["gap_after_update"] = float((engine.engine_probe_logprobs() - second.probe_logprobs).abs().max())
        third = engine.snapshot_weights(trainer, module)
        engine.load_snapshot(third)
        second_path = second.path
        del second  # nothing holds the second version any more (the engine holds the third)
        gc.collect()
        results["released_snapshot_removed"] = not os.path.exists(second_path) and os.path.isdir(third.path)
        results.update(_sampling(engine, policy, tokenizer))
        results["corrupted"] = _corrupted_sync_error(engine, trainer, module)
    finally:
        paths = list(engine.snapshots._paths)
        engine.teardown()
    results["all_removed_at_teardown"] = len(paths) > 0 and not any(os.path.exists(path) for path in paths)
    with open(out, "w") as handle:
        json.dump(results, handle)


def _sampling(engine, policy, tokenizer) -> dict:
    prompt = tokenizer(["12+34=", "7+8="], padding=True, return_tensors="pt")
    settings = SamplingSettings(max_new_tokens=6, temperature=1.0)
    samples = engine.sample(policy, tokenizer, prompt["input_ids"], prompt["attention_mask"], settings, 4, True, False, 1)
    ids = torch.cat([prompt["input_ids"].repeat_interleave(4, 0), samples.response_ids], 1)
    mask = torch.cat([prompt["attention_mask"].repeat_interleave(4, 0), torch.ones_like(samples.response_ids)], 1)
    with torch.no_grad():
        trainer_logprobs = response_logprobs(policy, ids, mask, samples.response_ids.shape[1], 1.0)
    valid = samples.response_ids != tokenizer.pad_token_id
    gap = (trainer_logprobs - samples.logprobs).abs()[valid].max()
    return {"sample_shape": list(samples.response_ids.shape), "sample_logprob_gap": float(gap)}


def _corrupted_sync_error(engine, trainer, module) -> str:
    """A snapshot whose file lost one layer on the way (zeroed): the load must refuse it."""
    snapshot = engine.snapshot_weights(trainer, module)
    path = os.path.join(snapshot.path, "model.safetensors")
    tensors = load_file(path)
    name = next(name for name in tensors if "layers.0.mlp.down_proj" in name)
    tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, path, metadata={"format": "pt"})
    try:
        engine.load_snapshot(snapshot)
    except RuntimeError as error:
        return str(error)
    return ""


if __name__ == "__main__":
    main()
