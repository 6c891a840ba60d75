"""Routing Replay: pi_old's experts are forced in pi_theta's forward, the router still learns, and routing drift
is measured exactly."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_lightning.logprobs import response_logprobs
from gspo_lightning.micro_batches import BatchLayout
from gspo_lightning.models import TinyQwen3, TinyQwen3Moe
from gspo_lightning.module import GSPOModule
from gspo_lightning.moe import capture_routes, expert_change_fraction, find_routers, replay_routes, replayed_weights
from gspo_lightning.rollout.minibatches import split_minibatches
from gspo_lightning.rollout.types import Minibatch
from tests.conftest import TINY
from tests.test_packing import _scores, _uneven_batch
from tests.test_module import _first_step

MOE = dict(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.fixture
def moe_policy():
    loader = TinyQwen3Moe(**MOE)
    return loader.load_model(loader.load_tokenizer()).eval()


def test_replayed_weights_are_the_current_softmax_at_the_forced_experts():
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]])).requires_grad_()  # probabilities 0.1 .. 0.4
    forced = torch.tensor([[0, 2]])
    weights = replayed_weights(logits, forced, normalize=False)
    torch.testing.assert_close(weights, torch.tensor([[0.1, 0.3]]), rtol=0, atol=1e-7)
    normalised = replayed_weights(logits, forced, normalize=True)
    torch.testing.assert_close(normalised, torch.tensor([[0.25, 0.75]]), rtol=0, atol=1e-7)
    normalised[0, 0].backward()  # d(p0 / (p0 + p2)) / d logit_j is non-zero only for the forced experts
    assert logits.grad[0, 1] == 0 and logits.grad[0, 3] == 0 and logits.grad[0, 0] > 0 > logits.grad[0, 2]


def test_expert_change_fraction_counts_replaced_experts_on_real_tokens_only():
    old = torch.tensor([[[[0, 1], [2, 3], [4, 5]]]])  # [n=1, layers=1, L=3, k=2]
    new = torch.tensor([[[[1, 0], [2, 7], [6, 7]]]])  # token 0: same set; token 1: one new; token 2: two new
    mask = torch.tensor([[1, 1, 0]])  # token 2 is padding
    assert expert_change_fraction(old, new, mask).tolist() == [pytest.approx(1 / 4)]
    assert expert_change_fraction(old, new, torch.ones(1, 3)).tolist() == [pytest.approx(3 / 6)]


def test_capture_then_replay_on_the_same_weights_changes_nothing(moe_policy):
    assert len(find_routers(moe_policy)) == TINY["num_layers"]
    ids = torch.randint(3, 17, (3, 7))
    with torch.no_grad(), capture_routes(moe_policy, (3, 7)) as captured:
        natural = moe_policy(input_ids=ids).logits
    routes = captured.stacked()  # [3, layers, 7, 2]
    with torch.no_grad(), replay_routes(moe_policy, routes) as replayed:
        forced = moe_policy(input_ids=ids).logits
    assert torch.equal(natural, forced)
    assert torch.equal(replayed.stacked(), routes)  # what the routers would choose: the same


def test_replay_forces_old_experts_after_the_router_changed_and_the_router_still_gets_gradient(moe_policy):
    ids = torch.randint(3, 17, (2, 5))
    with torch.no_grad(), capture_routes(moe_policy, (2, 5)) as captured:
        moe_policy(input_ids=ids)
    old_routes = captured.stacked()
    routers = find_routers(moe_policy)
    with torch.no_grad():
        for router in routers:  # a big update: routing changes for most tokens
            router.weight.add_(torch.randn_like(router.weight) * 5)
    with capture_routes(moe_policy, (2, 5)) as free:
        moe_policy(input_ids=ids)
    assert not torch.equal(free.stacked(), old_routes)
    block = moe_policy.model.layers[0].mlp
    hidden = torch.randn(1, 5, TINY["hidden_size"])
    forced = old_routes[:1, :1]  # layer 0's routes of sequence 0, as [1, 1, 5, 2]
    with replay_routes(block, forced):
        output = block(hidden)  # the block alone has one router
    logits = hidden.view(-1, TINY["hidden_size"]) @ block.gate.weight.T  # [5, E]
    weights = replayed_weights(logits, forced[0, 0].long(), normalize=True)  # [5, 2]
    expected = torch.zeros(5, TINY["hidden_size"])
    for token in range(5):
        for slot in range(2):
            expert = int(forced[0, 0, token, slot])
            gate, up = (hidden[0, token] @ block.experts.gate_up_proj[expert].T).chunk(2)
            expected[token] += weights[token, slot] * (torch.nn.functional.silu(gate) * up) @ block.experts.down_proj[expert].T
    torch.testing.assert_close(output[0], expected, rtol=1e-5, atol=1e-6)
    output.sum().backward()
    assert block.gate.weight.grad.abs().sum() > 0


def test_split_minibatches_records_old_routes_for_moe_policies_only(moe_policy, policy, tokenizer):
    from tests.rollout.test_minibatches import _rollout

    rollout = _rollout(tokenizer, policy, ["1+1=", "1+1=", "123+456=", "123+456="], [2, 3, 1, 2])
    moe_batch = split_minibatches(rollout, 2, moe_policy)[0]
    assert moe_batch.old_routes.shape == (len(moe_batch), TINY["num_layers"], moe_batch.input_ids.shape[1], 2)
    assert split_minibatches(rollout, 2, policy)[0].old_routes is None


@pytest.mark.parametrize("replay", ["off", "old"])
def test_moe_training_step_is_on_policy_and_logs_routing_drift(replay):
    module = GSPOModule(TinyQwen3Moe(**MOE), objective="grpo", routing_replay=replay)
    logged = _first_step(module)
    assert logged["train/ratio_mean"] == 1.0 and logged["train/clip_frac"] == 0.0
    assert logged["moe/expert_change_frac"] == 0.0 and logged["moe/expert_change_mb0"] == 0.0
    assert not math.isnan(logged["moe/expert_change_frac_layer1"])
    assert all(router.weight.grad is not None for router in find_routers(module.policy))
    module.on_train_batch_end(None, None, 0)
    assert not module._replay._exit_callbacks  # replay hooks removed after the step


def test_routing_replay_on_a_dense_policy_is_refused():
    module = GSPOModule(TinyQwen3(**TINY), routing_replay="old")
    with pytest.raises(ValueError, match="routing_replay: old needs a mixture-of-experts policy"):
        module.configure_model()


def test_routing_replay_without_recorded_experts_says_how_to_record_them():
    from gspo_lightning.rollout.types import PromptBatch

    module = GSPOModule(TinyQwen3Moe(**MOE), routing_replay="old")
    module.configure_model()
    ids = torch.randint(3, 17, (2, 6))
    mask = torch.ones(2, 3)
    minibatch = Minibatch(ids, torch.ones(2, 6), ids[:, 3:], mask, torch.zeros(2, 3), torch.ones(2), torch.ones(2))
    with pytest.raises(RuntimeError, match="pi_old's forward records them"):
        module.training_step(PromptBatch(["a", "b"], {}, minibatch=minibatch), 0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "replay, flags",
    [("old", []), ("rollout", []), ("rollout", ["--sampler.asynchronous.mode=fixed_lag"])],
    ids=["R2", "R3", "R3 fixed lag"],
)
def test_routing_replay_trains_through_the_cli_with_evaluation_between_steps(tmp_path, replay, flags):
    """Forced routing must end with the backward pass: the evaluation callback generates right after a step."""
    import csv
    import json
    import os
    import subprocess
    import sys

    from tests.test_cli import ROOT, tiny_run_config

    extra = {"sampler": {"rewards": ["tests.fault_helpers.length_reward"]}, "evaluation": {"every_n_steps": 1}}
    config = tiny_run_config(tmp_path, max_steps=5, extra=extra)
    policy = {"class_path": "gspo_lightning.models.TinyQwen3Moe", "init_args": MOE}
    command = [
        sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config), f"--model.init_args.routing_replay={replay}",
        "--model.init_args.objective=grpo", "--model.init_args.policy=" + json.dumps(policy), *flags,
    ]  # fmt: skip
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "runs/tiny/version_0/metrics.csv")))
    changes = [float(r["moe/expert_change_frac"]) for r in rows if r.get("moe/expert_change_frac")]
    assert len(changes) == 5 and (changes[0] == 0.0 or flags)  # sampled ahead: pi_old is not the sampler
    key = "moe/rollout_vs_old_change_frac"
    sampler_vs_old = [float(r[key]) for r in rows if r.get(key)]
    assert len(sampler_vs_old) == 5  # the hf engine records experts under every replay choice
    assert flags or sampler_vs_old == [0.0] * 5  # on-policy in the training precision: the same experts


LAYOUTS = {"packed": BatchLayout(packing=True), "padded, micro-batched": BatchLayout(False, 30),
           "packed, micro-batched": BatchLayout(True, 20)}  # fmt: skip


@pytest.fixture(scope="module")
def float32_moe():
    """float32: the experts' grouped matmul has no float64 kernel."""
    loader = TinyQwen3Moe(**MOE)
    torch.manual_seed(0)
    return loader.load_model(loader.load_tokenizer()).eval()


def _recorded(policy, ids, mask, r, layout):
    with torch.no_grad(), capture_routes(policy, tuple(ids.shape)) as captured:
        response_logprobs(policy, ids, mask, r, layout=layout)
    return captured.stacked().transpose(1, 2)[mask.bool()]  # [real tokens, layers, k]


@pytest.mark.parametrize("name", LAYOUTS)
def test_experts_are_recorded_per_token_whatever_the_layout(float32_moe, name):
    ids, mask, r = _uneven_batch(float32_moe.config.vocab_size, seed=4)
    torch.testing.assert_close(_recorded(float32_moe, ids, mask, r, LAYOUTS[name]),
                               _recorded(float32_moe, ids, mask, r, BatchLayout()), rtol=0, atol=0)  # fmt: skip


@pytest.mark.parametrize("checkpointed", [False, True], ids=["", "activation checkpointing"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_routing_replay_whatever_the_layout_has_the_padded_gradients(float32_moe, name, checkpointed):
    """pi_old's experts recorded on the padded minibatch, replayed in pi_theta (its routers moved, so the experts
    it would choose differ): packed rows and micro-batches force each token's own experts, also when a decoder
    layer's forward is recomputed in backward (micro-batch by micro-batch)."""
    import copy

    from gspo_lightning.strategies import shard_for_strategy

    ids, mask, r = _uneven_batch(float32_moe.config.vocab_size, seed=4)
    with torch.no_grad(), capture_routes(float32_moe, tuple(ids.shape)) as captured:
        response_logprobs(float32_moe, ids, mask, r)
    routes = captured.stacked()
    theta = copy.deepcopy(float32_moe)
    with torch.no_grad():
        for router in find_routers(theta):
            router.weight.add_(torch.randn_like(router.weight) * 0.5)
    assert _recorded(theta, ids, mask, r, BatchLayout()).ne(routes.transpose(1, 2)[mask.bool()]).any()
    if checkpointed:
        shard_for_strategy(theta, None, None, activation_checkpointing=True)
    results = []
    for layout in (BatchLayout(), LAYOUTS[name]):
        with replay_routes(theta, routes):
            results.append(_scores(theta, ids, mask, r, layout, 1024))
    (_, padded_loss, padded_grads), (_, loss, grads) = results
    torch.testing.assert_close(loss, padded_loss, atol=1e-6, rtol=0)
    for parameter, grad in padded_grads.items():
        torch.testing.assert_close(grads[parameter], grad, atol=1e-5, rtol=1e-4, msg=parameter)


def test_routing_replay_names_its_choices_and_what_true_became():
    with pytest.raises(ValueError, match=r"model.routing_replay must be one of \['off', 'old', 'rollout'\], got 'r3'"):
        GSPOModule(TinyQwen3Moe(**MOE), routing_replay="r3")
    with pytest.raises(ValueError, match="routing_replay: true is now model.routing_replay: old"):
        GSPOModule(TinyQwen3Moe(**MOE), routing_replay=True)
    assert GSPOModule(TinyQwen3Moe(**MOE), routing_replay=False).routing_replay == "off"  # YAML's unquoted off
