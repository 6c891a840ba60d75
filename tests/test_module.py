import pytest
import torch

from gspo_lightning.models import TinyQwen3
from gspo_lightning.module import GSPOModule
from gspo_lightning.objectives import ObjectiveSpec
from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.rollout.minibatches import split_minibatches
from gspo_lightning.rollout.round import RoundModel
from gspo_lightning.sampling.sampler import GroupSampler
from gspo_lightning.rollout.types import PromptBatch
from tests.conftest import TINY


@pytest.mark.parametrize(
    ("objective", "clip_range"),
    [("gspo", (3e-4, 4e-4)), ("gspo_token", (3e-4, 4e-4)), ("grpo", (0.2, 0.27)), ("dapo", (0.2, 0.28)),
     ("gmpo", (0.4, 0.4)), ("cispo", (1.0, 0.28))],  # fmt: skip
)
def test_paper_clip_ranges_are_the_defaults(objective, clip_range):
    module = GSPOModule(TinyQwen3(**TINY), objective=objective)
    assert (module.eps_low, module.eps_high) == clip_range


def test_a_clip_range_outside_the_objectives_bounds_is_rejected():
    with pytest.raises(ValueError, match=r"model.eps_low must be in \(0, 1\) for objective 'gspo', got 1.5"):
        GSPOModule(TinyQwen3(**TINY), eps_low=1.5)
    assert GSPOModule(TinyQwen3(**TINY), objective="gmpo", eps_low=1.5).eps_low == 1.5  # log space: wider


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eps_low": 0.0}, r"model.eps_low must be in \(0, 1\) for objective 'gspo', got 0.0"),
        ({"eps_high": 1.0}, r"model.eps_high must be in \(0, 1\) for objective 'gspo', got 1.0"),
        ({"objective": "ppo"}, r"model.objective: unknown objective 'ppo'; allowed names: cispo, dapo, dr_grpo"),
        ({"temperature": 0.0}, "model.temperature must be > 0"),
    ],
)
def test_bad_settings_fail_before_the_model_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GSPOModule(TinyQwen3(**TINY), **kwargs)


def _fresh_rollout(module: GSPOModule):
    """The module set up for fitting, a one-minibatch prompt batch and its freshly sampled rollout."""
    module.configure_model()
    module.on_fit_start()
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=4, num_minibatches=1)
    batch = PromptBatch(["1+1=", "2+2="], {"answer": ["2", "4"]}, num_minibatches=1)
    torch.manual_seed(0)
    short = RoundModel(module.policy, module.tokenizer, module.temperature, max_new_tokens=4)
    return batch, sampler.sample(short, batch.prompts, batch.columns)


def _first_step(module: GSPOModule) -> dict:
    """One training step on a fresh rollout, with log/log_dict captured."""
    batch, rollout = _fresh_rollout(module)
    batch.minibatch = split_minibatches(rollout, 1, module.policy, reference=module.reference_policy)[0]
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    module.log_dict = lambda values, **kwargs: logged.update(values)
    module.training_step(batch, 0).backward()
    return logged


@pytest.mark.parametrize("objective", ["gspo", "gspo_token", "grpo", "dapo", "dr_grpo"])
def test_training_step_on_first_minibatch_is_on_policy(objective):
    module = GSPOModule(TinyQwen3(**TINY), objective=objective)
    logged = _first_step(module)
    assert logged["train/ratio_mean"] == 1.0 and logged["train/clip_frac"] == 0.0
    assert logged["diag/kl_old_theta"] == 0.0 and logged["drift/kl_old_theta_mb0"] == 0.0
    assert logged["train/entropy"] > 0
    assert all(p.grad is not None for p in module.policy.parameters() if p.requires_grad)
    assert module.reference_policy is None


def test_kl_penalty_uses_a_frozen_reference_kept_on_cpu():
    spec = ObjectiveSpec("gspo", kl_coef=0.1, kl_estimator="k3")
    module = GSPOModule(TinyQwen3(**TINY), objective=spec, reference_on_cpu=True)
    logged = _first_step(module)
    reference = module.reference_policy
    assert reference is not None and not any(p.requires_grad for p in reference.parameters())
    assert next(reference.parameters()).device.type == "cpu"
    assert "reference" not in "".join(module.state_dict())  # rebuilt from the loader, not checkpointed
    assert logged["train/kl"] == 0.0  # policy == reference before any update


def test_a_kl_reward_penalty_builds_the_reference_and_leaves_the_loss_alone():
    spec = ObjectiveSpec("gspo", kl_coef=0.1, kl_estimator="k1", kl_in="reward")
    module = GSPOModule(TinyQwen3(**TINY), objective=spec)
    logged = _first_step(module)
    assert module.reference_policy is not None and module.kl_reward_penalty.coef == 0.1
    assert logged["train/kl"] == 0.0 and GSPOModule(TinyQwen3(**TINY)).kl_reward_penalty is None


def test_dr_grpo_normalises_by_the_generation_budget_unless_told_otherwise():
    assert GSPOModule(TinyQwen3(**TINY), objective="dr_grpo", max_new_tokens=32).objective.options["max_tokens"] == 32
    spec = ObjectiveSpec("dr_grpo", options={"max_tokens": 7})
    assert GSPOModule(TinyQwen3(**TINY), objective=spec, max_new_tokens=32).objective.options["max_tokens"] == 7
    assert GSPOModule(TinyQwen3(**TINY), objective="grpo").objective.options == {}


def test_training_step_without_sampler_says_what_is_missing():
    module = GSPOModule(TinyQwen3(**TINY))
    with pytest.raises(RuntimeError, match="add gspo_lightning.GroupSampler"):
        module.training_step(PromptBatch(["1+1="], {}), 0)


def _off_policy_gradients(chunk_size: int, objective, **layout) -> tuple[dict, dict]:
    """Parameter gradients and logged values of one training step whose pi_old differs from pi_theta."""
    module = GSPOModule(TinyQwen3(**TINY), objective=objective, logprob_chunk_size=chunk_size, **layout)
    batch, rollout = _fresh_rollout(module)
    rollout.advantages = torch.linspace(-1.0, 1.0, len(rollout.advantages))
    minibatch = split_minibatches(
        rollout, 1, module.policy, reference=module.reference_policy, layout=module.batch_layout
    )[0]
    # pi_old away from pi_theta on every other response, the ratio growing with the advantage, so that some
    # responses and tokens clip and others do not
    old = minibatch.old_logprobs  # [n, R]
    shift = torch.linspace(-0.3, 0.3, old.numel()).view_as(old) * (torch.arange(len(old)) % 2)[:, None]
    minibatch.old_logprobs = old - shift
    batch.minibatch = minibatch
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    module.log_dict = lambda values, **kwargs: logged.update(values)
    module.training_step(batch, 0).backward()
    return {name: p.grad.clone() for name, p in module.policy.named_parameters()}, logged


@pytest.mark.parametrize(
    "objective", ["gspo", "grpo", "dr_grpo", ObjectiveSpec("gspo", kl_coef=0.1, kl_estimator="k3")]
)
def test_chunked_training_step_has_the_materialised_gradients(monkeypatch, objective):
    from gspo_lightning import chunked_logprobs

    recomputed = []
    real = chunked_logprobs._recomputed_grads
    monkeypatch.setattr(chunked_logprobs, "_recomputed_grads", lambda *a: recomputed.append(1) or real(*a))
    naive, naive_logged = _off_policy_gradients(0, objective)
    for chunk_size in (4, 1024):  # one response per chunk, and all in one
        chunked, logged = _off_policy_gradients(chunk_size, objective)
        assert 0 < naive_logged["train/clip_frac"] < 1 and logged["train/clip_frac"] == naive_logged["train/clip_frac"]
        torch.testing.assert_close(logged["train/entropy"], naive_logged["train/entropy"], atol=1e-5, rtol=0)
        for name, grad in naive.items():
            torch.testing.assert_close(chunked[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert recomputed == []  # the objective's gradient was predicted in forward every time


@pytest.mark.parametrize("objective", ["gspo", "dapo", ObjectiveSpec("gspo", kl_coef=0.1, kl_estimator="k3")])
def test_a_packed_training_step_has_the_padded_gradients(objective):
    """pi_old's, the reference's and pi_theta's passes all packed: the same step as padded, to float32 rounding."""
    padded, padded_logged = _off_policy_gradients(1024, objective)
    packed, packed_logged = _off_policy_gradients(1024, objective, packing=True)
    assert packed_logged["train/clip_frac"] == padded_logged["train/clip_frac"]
    torch.testing.assert_close(packed_logged["train/loss"], padded_logged["train/loss"], atol=1e-6, rtol=0)
    for name, grad in padded.items():
        torch.testing.assert_close(packed[name], grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("objective", ["gspo", "dapo", ObjectiveSpec("gspo", kl_coef=0.1, kl_estimator="k3")])
def test_a_micro_batched_training_step_has_the_single_batch_update(objective, packing):
    """A token budget of a few sequences: pi_old's, the reference's and pi_theta's passes cut into micro-batches,
    the normalisers still the minibatch's, so the step's loss and gradients are the single-batch step's."""
    whole, whole_logged = _off_policy_gradients(1024, objective, packing=packing, max_new_tokens=4)
    cut, cut_logged = _off_policy_gradients(1024, objective, packing=packing, max_new_tokens=4, micro_batch_tokens=20)
    assert cut_logged["train/clip_frac"] == whole_logged["train/clip_frac"]
    torch.testing.assert_close(cut_logged["train/loss"], whole_logged["train/loss"], atol=1e-6, rtol=0)
    for name, grad in whole.items():
        torch.testing.assert_close(cut[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_micro_batch_tokens_is_validated():
    with pytest.raises(ValueError, match=r"model.micro_batch_tokens must be null or > model.max_new_tokens \(256\)"):
        GSPOModule(TinyQwen3(**TINY), micro_batch_tokens=256)


def test_logprob_chunk_size_is_validated():
    with pytest.raises(ValueError, match="model.logprob_chunk_size must be >= 0"):
        GSPOModule(TinyQwen3(**TINY), logprob_chunk_size=-1)


def test_under_bf16_true_the_kl_reference_runs_in_the_policys_dtype(tmp_path):
    import lightning.pytorch as pl

    from gspo_lightning.data import ArithmeticTask, PromptDataModule
    from tests.fault_helpers import length_reward

    spec = ObjectiveSpec("gspo", kl_coef=0.1, kl_estimator="k3")
    module = GSPOModule(TinyQwen3(**TINY), objective=spec, max_new_tokens=4)
    data = PromptDataModule(ArithmeticTask(train_size=32, eval_size=4), "{question}=", prompts_per_rollout=2,
                            minibatches_per_rollout=1)  # fmt: skip
    sampler = GroupSampler(rewards=[length_reward], group_size=2, num_minibatches=1)
    trainer = pl.Trainer(
        max_steps=1, accelerator="cpu", precision="bf16-true", logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[sampler],
    )  # fmt: skip
    trainer.fit(module, data)
    assert {p.dtype for p in module.policy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in module.reference_policy.parameters()} == {torch.bfloat16}
    assert trainer.callback_metrics["train/kl"] == 0.0  # the same function of the same weights as the policy


def _gradients_and_saved_bytes(**module_kwargs) -> tuple[dict, int]:
    """One training step's parameter gradients, and the bytes autograd saved for backward during its forward."""
    module = GSPOModule(TinyQwen3(**{**TINY, "num_layers": 4}), objective="grpo", **module_kwargs)
    batch, rollout = _fresh_rollout(module)
    batch.minibatch = split_minibatches(rollout, 1, module.policy)[0]
    module.log = module.log_dict = lambda *args, **kwargs: None
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = module.training_step(batch, 0)
    forward_bytes = sum(saved)
    loss.backward()
    names = {name: name.replace("._checkpoint_wrapped_module", "") for name, _ in module.policy.named_parameters()}
    return {names[name]: p.grad.clone() for name, p in module.policy.named_parameters()}, forward_bytes


def test_activation_checkpointing_keeps_the_gradients_and_saves_fewer_activations():
    plain, plain_bytes = _gradients_and_saved_bytes()
    checkpointed, checkpointed_bytes = _gradients_and_saved_bytes(activation_checkpointing=True)
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert checkpointed_bytes < 0.5 * plain_bytes, (checkpointed_bytes, plain_bytes)


class _HFCheckpointing(TinyQwen3):
    """A loader that turns on Hugging Face's gradient checkpointing, a no-op for a policy kept in eval mode."""

    def load_model(self, tokenizer):
        model = super().load_model(tokenizer)
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model


def test_hugging_face_gradient_checkpointing_is_replaced_by_one_that_works_in_eval_mode():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    module = GSPOModule(_HFCheckpointing(**TINY))
    with pytest.warns(UserWarning, match="does nothing in eval mode"):
        module.configure_model()
    policy = module.policy
    assert not (policy.is_activation_checkpointing if hasattr(policy, "activation_checkpointing_enable")
                else policy.is_gradient_checkpointing)  # fmt: skip
    assert sum(isinstance(m, CheckpointWrapper) for m in module.policy.modules()) == TINY["num_layers"]


def test_a_rollout_correction_reweights_the_objective_and_logs_the_mismatch():
    from gspo_lightning.engines import HFEngine
    from gspo_lightning.objectives import RolloutCorrection, correct_rollout

    module = GSPOModule(TinyQwen3(**TINY), rollout_correction=RolloutCorrection("tis", 2.0), max_new_tokens=4)
    module.configure_model()
    module.on_fit_start()
    assert module.needs_engine_logprobs
    # a bfloat16 sampling pass stands in for an engine whose log-probs differ from the trainer's
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=4, num_minibatches=1,
                           engine=HFEngine(sampling_dtype="bfloat16"))  # fmt: skip
    batch = PromptBatch(["1+1=", "2+2="], {"answer": ["2", "4"]}, num_minibatches=1)
    torch.manual_seed(0)
    rollout = sampler.sample(module, batch.prompts, batch.columns)
    minibatch = split_minibatches(rollout, 1, module.policy)[0]
    minibatch.advantages = torch.linspace(-1.0, 1.0, len(minibatch))
    assert minibatch.engine_logprobs is not None and not torch.equal(minibatch.engine_logprobs, minibatch.old_logprobs)
    batch.minibatch = minibatch
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    loss = module.training_step(batch, 0)
    corrected = correct_rollout(module.rollout_correction, minibatch.old_logprobs, minibatch.engine_logprobs,
                                minibatch.advantages, minibatch.response_mask, sequence_level=True)  # fmt: skip
    from gspo_lightning.objectives import objective_loss

    expected, _ = objective_loss(module.objective, minibatch.old_logprobs, minibatch.old_logprobs,
                                 corrected.advantages, corrected.mask, module.eps_low, module.eps_high)  # fmt: skip
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-7)  # on-policy: s_i = 1
    assert not torch.allclose(corrected.advantages, minibatch.advantages)  # the weights did something
    assert logged["mismatch/kl"] > 0 and "mismatch/log_ratio_p95" in logged and "mismatch/truncated_frac" in logged
