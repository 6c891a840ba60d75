"""Packed rows: the layout by hand, and the packed forward against the padded one (values, entropies and
gradients, with and without the chunked head's prediction) on uneven batches."""

from __future__ import annotations

import pytest
import torch

from gspo_lightning.logprobs import response_scores
from gspo_lightning.micro_batches import BatchLayout
from gspo_lightning.objectives import OBJECTIVES, ObjectiveSpec, objective_gradient, objective_loss
from gspo_lightning.packing import pack, response_predictors, row_assignment, unpack


def test_rows_are_filled_first_fit_longest_first():
    assert row_assignment([3, 5, 2, 4, 1], 6) == [[1, 4], [2, 3], [0]]
    assert row_assignment([], 6) == []
    with pytest.raises(ValueError, match="a sequence of 7 tokens does not fit in rows of 6"):
        row_assignment([7], 6)


def test_pack_by_hand():
    ids = torch.tensor([[0, 7, 8, 9], [5, 6, 0, 0], [0, 3, 4, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0]])
    packed = pack(ids, mask)
    assert packed.input_ids.tolist() == [[7, 8, 9, 0], [5, 6, 3, 4]]  # [0] and a tail; [1] and [2] share a row
    assert packed.position_ids.tolist() == [[0, 1, 2, 0], [0, 1, 0, 1]]  # restart per sequence and at the tail
    assert packed.packed_index.tolist() == [[-1, 0, 1, 2], [4, 5, -1, -1], [-1, 6, 7, -1]]
    values = torch.arange(8.0).view(2, 4)
    assert unpack(values, packed, fill=-1.0).tolist() == [[-1, 0, 1, 2], [4, 5, -1, -1], [-1, 6, 7, -1]]
    predictor, target = response_predictors(packed, mask, 2)  # responses: the last 2 columns
    assert target.tolist() == [0, 1, 4]  # (0, 0), (0, 1) and (2, 0) of [3, 2]: the attended ones
    assert predictor.tolist() == [0, 1, 6]  # the token before each: 7 and 8 of sequence 0, 3 of sequence 2
    with pytest.raises(ValueError, match="not preceded by a real token"):
        no_prompt = mask.index_fill(1, torch.tensor([1]), 0)  # sequence 2 starts with its response
        response_predictors(pack(ids, no_prompt), no_prompt, 2)


PADDED, PACKED = BatchLayout(), BatchLayout(packing=True)


def _uneven_batch(vocab: int, seed: int = 0):
    """Left-padded prompts of 1-6 tokens, right-padded responses of 1-9 (one of them empty but for EOS)."""
    generator = torch.Generator().manual_seed(seed)
    prompts, responses = [3, 6, 1, 5, 2, 4], [9, 1, 7, 3, 9, 5]
    lp, r = max(prompts), max(responses)
    ids = torch.randint(3, vocab, (len(prompts), lp + r), generator=generator)
    mask = torch.zeros_like(ids)
    for i, (p, n) in enumerate(zip(prompts, responses, strict=True)):
        mask[i, lp - p : lp + n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, r


def _scores(policy, ids, mask, r, layout, chunk_size, objective="gspo", predict=True):
    policy.zero_grad(set_to_none=True)
    response_mask = mask[:, -r:].bool()
    generator = torch.Generator().manual_seed(1)
    old = -torch.rand(response_mask.shape, generator=generator, dtype=torch.float64) * 3  # [n, R]
    old = old.masked_fill(~response_mask, 0)
    advantages = torch.randn(len(ids), generator=generator, dtype=torch.float64)
    spec = ObjectiveSpec(objective)
    eps = OBJECTIVES[objective].clip_range
    terms = (old, advantages, response_mask, *eps)
    predictor = objective_gradient(spec, *terms) if predict and chunk_size else None
    scores = response_scores(policy, ids, mask, r, 0.7, chunk_size, with_entropy=True, predict_upstream=predictor,
                             layout=layout)  # fmt: skip
    loss, _ = objective_loss(spec, scores.logprobs, *terms)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}
    return scores, loss.detach(), grads


@pytest.mark.parametrize("chunk_size", [0, 4, 1024])
def test_packed_scores_and_gradients_equal_the_padded_ones_in_float64(float64_policy, chunk_size):
    ids, mask, r = _uneven_batch(float64_policy.config.vocab_size)
    padded, padded_loss, padded_grads = _scores(float64_policy, ids, mask, r, PADDED, chunk_size)
    packed, packed_loss, packed_grads = _scores(float64_policy, ids, mask, r, PACKED, chunk_size)
    response_mask = mask[:, -r:].bool()
    torch.testing.assert_close(packed.logprobs[response_mask], padded.logprobs[response_mask], atol=1e-10, rtol=0)
    torch.testing.assert_close(packed.entropy[response_mask], padded.entropy[response_mask], atol=1e-10, rtol=0)
    assert (packed.logprobs[~response_mask] == 0).all()
    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-12, rtol=0)
    assert padded_grads.keys() == packed_grads.keys()
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-10, rtol=1e-8, msg=name)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_objective_packed_equals_padded_in_float64(float64_policy, name, monkeypatch):
    """The registry, walked: a new objective is covered without new code. Separable objectives keep the chunked
    head's prediction when packed (no recompute in backward)."""
    from gspo_lightning import chunked_logprobs

    ids, mask, r = _uneven_batch(float64_policy.config.vocab_size, seed=2)
    _, padded_loss, padded_grads = _scores(float64_policy, ids, mask, r, PADDED, 1024, name)
    recomputed = []
    real = chunked_logprobs._recomputed_grads
    monkeypatch.setattr(chunked_logprobs, "_recomputed_grads", lambda *a: recomputed.append(1) or real(*a))
    _, packed_loss, packed_grads = _scores(float64_policy, ids, mask, r, PACKED, 1024, name)
    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-6, rtol=0)
    for parameter, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[parameter], grad, atol=1e-6, rtol=0, msg=parameter)
    assert any(grad.abs().sum() > 0 for grad in packed_grads.values())
    assert (recomputed == []) == OBJECTIVES[name].separable


def test_a_model_that_ignores_the_restarting_positions_is_refused(float64_policy, monkeypatch):
    from gspo_lightning.logprobs import check_packing

    check_packing(float64_policy)  # Hugging Face's Qwen3 with sdpa: passes
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)  # one causal block
    with pytest.raises(RuntimeError, match="does not keep packed sequences apart .* set model.packing: false"):
        check_packing(float64_policy)


@pytest.mark.slow
def test_a_packed_cli_run_trains_as_the_padded_one(tmp_path):
    """Through the CLI, every pass packed (and then also cut into micro-batches of 40 tokens): the per-step
    figures follow the padded run's to float rounding."""
    import csv
    import subprocess
    import sys

    from tests.test_cli import tiny_run_config

    variants = {"padded": [], "packed": ["--model.init_args.packing=true"]}
    variants["micro-batched"] = [*variants["packed"], "--model.init_args.micro_batch_tokens=40"]
    figures = {}
    for variant, options in variants.items():
        directory = tmp_path / variant
        directory.mkdir()
        command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(tiny_run_config(directory, 8, 8)), *options]
        result = subprocess.run(command, capture_output=True, text=True, cwd=directory)
        assert result.returncode == 0, result.stderr[-3000:]
        rows = csv.DictReader((directory / "runs/tiny/version_0/metrics.csv").open())
        figures[variant] = [(float(r["train/loss"]), float(r["rollout/reward_mean"])) for r in rows if r["train/loss"]]
    for variant in ("packed", "micro-batched"):
        assert len(figures[variant]) == 8
        for (loss, reward), (padded_loss, padded_reward) in zip(figures[variant], figures["padded"], strict=True):
            assert reward == padded_reward and abs(loss - padded_loss) < 1e-5, variant
