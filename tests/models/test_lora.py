"""LoRA through peft: only the adapter trains and is exported; merged exports match; the CLI builds it."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml

from gspo_lightning import GroupSampler, GSPOModule
from gspo_lightning.cli import main
from gspo_lightning.data import ArithmeticTask, PromptDataModule
from gspo_lightning.logprobs import response_logits
from gspo_lightning.models import LoRA, PolicyLoader, TinyQwen3
from gspo_lightning.objectives import ObjectiveSpec
from gspo_lightning.rollout.minibatches import split_minibatches
from gspo_lightning.rollout.types import PromptBatch
from tests.conftest import TINY
from tests.fault_helpers import length_reward
from tests.test_cli import ROOT, tiny_run_config

peft = pytest.importorskip("peft")


def _lora(**kwargs) -> LoRA:
    return LoRA(TinyQwen3(**TINY), r=4, **kwargs)


def _is_adapter(name: str) -> bool:
    return "lora_" in name


def _randomise_adapter(model: torch.nn.Module) -> None:
    """A fresh adapter is the identity (lora_B = 0); give it weights so that exports have something to show."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


def _logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits


def _input_ids(tokenizer, rows: int = 3, length: int = 9) -> torch.Tensor:
    return torch.randint(2, len(tokenizer), (rows, length), generator=torch.Generator().manual_seed(1))


def _base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items() if not _is_adapter(name)}


def test_only_adapter_weights_require_grad_and_are_optimised():
    module = GSPOModule(_lora(), optimizer=functools.partial(torch.optim.AdamW, weight_decay=0.1))
    module.configure_model()
    policy = module.policy
    assert isinstance(policy, peft.PeftModel)
    named = dict(policy.named_parameters())
    trainable = {name for name, parameter in named.items() if parameter.requires_grad}
    assert trainable and all(_is_adapter(name) for name in trainable)
    # all-linear: every projection of every layer, and not the (tied) output head or the embeddings
    assert sum("q_proj.lora_A" in name for name in trainable) == TINY["num_layers"]
    assert sum("down_proj.lora_B" in name for name in trainable) == TINY["num_layers"]
    optimised = {id(p) for group in module.configure_optimizers()["optimizer"].param_groups for p in group["params"]}
    assert optimised == {id(named[name]) for name in trainable}
    # the adapter starts as the identity: lora_B is zero, so a change of lora_B after training is an update
    assert all(not named[name].any() for name in trainable if "lora_B" in name)


def test_target_modules_choose_the_adapted_layers(tokenizer):
    model = _lora(target_modules=["q_proj", "v_proj"]).load_model(tokenizer)
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters() if _is_adapter(name)}
    assert adapted == {"q_proj", "v_proj"}


def test_tokenizer_comes_from_the_base():
    loader = _lora()
    assert loader.load_tokenizer().get_vocab() == TinyQwen3(**TINY).load_tokenizer().get_vocab()


def test_default_export_is_the_model_itself(policy):
    class Plain(PolicyLoader):
        def load_tokenizer(self):
            raise NotImplementedError

        def load_model(self, tokenizer):
            raise NotImplementedError

    assert Plain().model_for_export(policy) is policy


def test_logits_to_keep_and_generate_work_through_the_peft_wrapper(tokenizer):
    model = _lora().load_model(tokenizer).eval()
    _randomise_adapter(model)
    input_ids = _input_ids(tokenizer)
    kept = response_logits(model, input_ids, torch.ones_like(input_ids), response_length=4)
    full = _logits(model, input_ids)
    assert kept.shape[1] == 4
    torch.testing.assert_close(kept, full[:, -5:-1])
    generated = model.generate(input_ids=input_ids[:, :3], max_new_tokens=2, do_sample=False)
    assert generated.shape == (3, 5)


def test_kl_reference_is_a_frozen_copy_of_the_initial_adapted_policy():
    spec = ObjectiveSpec("gspo", kl_coef=0.1, kl_estimator="k3")
    adamw = functools.partial(torch.optim.AdamW, lr=1e-2)
    module = GSPOModule(_lora(), objective=spec, optimizer=adamw, max_new_tokens=4)
    module.configure_model()
    module.on_fit_start()
    reference = module.reference_policy
    assert isinstance(reference, peft.PeftModel) and not any(p.requires_grad for p in reference.parameters())

    # length_reward varies for an untrained policy: a gradient to follow (at step 0 the KL term has none)
    sampler = GroupSampler(rewards=[length_reward], group_size=4, num_minibatches=1)
    batch = PromptBatch(["1+1=", "2+2="], {"answer": ["2", "4"]}, num_minibatches=1)
    torch.manual_seed(0)
    rollout = sampler.sample(module, batch.prompts, batch.columns)
    batch.minibatch = split_minibatches(rollout, 1, module.policy, reference=reference)[0]
    logged = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)
    module.log_dict = lambda values, **kwargs: logged.update(values)
    module.training_step(batch, 0).backward()
    assert logged["train/ratio_mean"] == 1.0 and logged["train/kl"] == 0.0
    grads = {name for name, p in module.policy.named_parameters() if p.grad is not None}
    assert grads and all(_is_adapter(name) for name in grads)

    optimizer = module.configure_optimizers()["optimizer"]  # held: the scheduler only keeps a weakref
    optimizer.step()
    moved = dict(module.policy.named_parameters())
    frozen = dict(reference.named_parameters())
    assert any(not torch.equal(moved[name], frozen[name]) for name in moved if "lora_B" in name)
    assert all(not frozen[name].any() for name in frozen if "lora_B" in name)


def test_adapter_export_reloads_with_identical_logits(tokenizer, tmp_path):
    loader = _lora()
    model = loader.load_model(tokenizer).eval()
    _randomise_adapter(model)
    exported = loader.model_for_export(model)
    assert exported is model
    exported.save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert not files & {"config.json", "model.safetensors"}  # the base weights are not duplicated
    assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == 4

    reloaded = peft.PeftModel.from_pretrained(TinyQwen3(**TINY).load_model(tokenizer), tmp_path).eval()
    input_ids = _input_ids(tokenizer)
    assert torch.equal(_logits(reloaded, input_ids), _logits(model, input_ids))


def test_merged_export_is_a_plain_model_with_the_same_logits(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    loader = _lora(merge_on_export=True)
    model = loader.load_model(tokenizer).eval()
    _randomise_adapter(model)
    input_ids = _input_ids(tokenizer)
    adapted = _logits(model, input_ids)
    before = {name: value.clone() for name, value in model.state_dict().items()}

    merged = loader.model_for_export(model)
    assert not isinstance(merged, peft.PeftModel) and type(merged).__name__ == "Qwen3ForCausalLM"
    assert not any(_is_adapter(name) for name in merged.state_dict())
    torch.testing.assert_close(_logits(merged, input_ids), adapted, atol=1e-5, rtol=1e-5)
    # the training model is untouched: still wrapped, same weights, same function
    assert isinstance(model, peft.PeftModel)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    assert torch.equal(_logits(model, input_ids), adapted)

    merged.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(_logits(loaded, input_ids), adapted, atol=1e-5, rtol=1e-5)


def test_export_of_a_model_lora_did_not_build_is_refused(policy):
    with pytest.raises(TypeError, match="expects the PeftModel"):
        _lora().model_for_export(policy)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"r": 0}, r"LoRA.r must be an integer >= 1, got 0"),
        ({"r": 2.5}, r"LoRA.r must be an integer >= 1, got 2.5"),
        ({"alpha": 0}, r"LoRA.alpha must be a number > 0, got 0"),
        ({"dropout": 1.0}, r"LoRA.dropout must be in \[0, 1\), got 1.0"),
        ({"dropout": -0.1}, r"LoRA.dropout must be in \[0, 1\), got -0.1"),
        ({"target_modules": []}, r"LoRA.target_modules must be 'all-linear', a module-name regex or a non-empty"),
        ({"target_modules": ["q_proj", ""]}, r"LoRA.target_modules must be"),
        ({"target_modules": " "}, r"LoRA.target_modules must be"),
        ({"base": "TinyQwen3"}, r"LoRA.base must be a PolicyLoader other than LoRA"),
        ({"base": LoRA(TinyQwen3(**TINY))}, r"LoRA.base must be a PolicyLoader other than LoRA"),
    ],
)
def test_bad_settings_are_rejected(kwargs, message):
    settings = {"base": TinyQwen3(**TINY), **kwargs}
    with pytest.raises(ValueError, match=message):
        LoRA(**settings)


def test_dropout_warns_that_the_policy_stays_in_eval_mode():
    with pytest.warns(UserWarning, match="no effect under GSPOModule"):
        loader = _lora(dropout=0.1)
    assert loader.dropout == 0.1


def test_missing_peft_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # makes `import peft` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'gspo-lightning\[peft\]'"):
        _lora()


def _lora_policy(r: int = 8) -> dict:
    base = {"class_path": "gspo_lightning.models.TinyQwen3", "init_args": TINY}
    return {"class_path": "gspo_lightning.models.LoRA", "init_args": {"base": base, "r": r}}


def _lora_run_config(tmp_path: Path, max_steps: int, extra: dict | None = None) -> Path:
    config_path = tiny_run_config(tmp_path, max_steps=max_steps, checkpoint_every=max_steps, extra=extra)
    config = yaml.safe_load(config_path.read_text())
    config["model"]["init_args"]["policy"] = _lora_policy()
    config_path.write_text(yaml.safe_dump(config))
    return config_path


def test_lora_parses_from_yaml_through_the_cli(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = main(["-c", str(_lora_run_config(tmp_path, max_steps=2))], run=False)
    loader = cli.model.policy_loader
    assert isinstance(loader, LoRA) and isinstance(loader.base, TinyQwen3)
    assert (loader.r, loader.alpha, loader.target_modules) == (8, 32, "all-linear")
    assert loader.base.hidden_size == TINY["hidden_size"]
    cli.model.configure_model()
    assert isinstance(cli.model.policy, peft.PeftModel)


def test_one_lightning_fit_moves_the_adapter_and_not_the_base(tmp_path):
    torch.manual_seed(0)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    module = GSPOModule(_lora(), optimizer=adamw, max_new_tokens=4)
    module.configure_model()  # idempotent: fit reuses this policy, so the snapshot below is of what trains
    base_before = _base_state(module.policy)
    adapter_before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    data = PromptDataModule(
        ArithmeticTask(train_size=64, eval_size=8), "{question}=", prompts_per_rollout=2, minibatches_per_rollout=2
    )
    sampler = GroupSampler(rewards=[length_reward], group_size=4, num_minibatches=2)
    trainer = pl.Trainer(
        max_steps=2, limit_train_batches=2, max_epochs=1, accelerator="cpu", logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=tmp_path, callbacks=[sampler],
    )  # fmt: skip
    trainer.fit(module, data)
    assert trainer.global_step == 2
    base_after = _base_state(module.policy)
    assert base_after.keys() == base_before.keys()
    assert all(torch.equal(base_after[name], base_before[name]) for name in base_before)
    adapter_after = dict(module.policy.named_parameters())
    assert any(not torch.equal(adapter_after[name], value) for name, value in adapter_before.items())


@pytest.mark.slow
def test_cli_fit_trains_and_exports_the_adapter_only(tmp_path):
    # length_reward varies even for an untrained policy, so the 2 steps have a gradient to follow
    config = _lora_run_config(
        tmp_path, max_steps=2, extra={"sampler": {"rewards": ["tests.fault_helpers.length_reward"]}}
    )
    command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config)]
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]

    state = torch.load(tmp_path / "ckpt/last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    tokenizer = TinyQwen3(**TINY).load_tokenizer()
    fresh = LoRA(TinyQwen3(**TINY), r=8).load_model(tokenizer).state_dict()  # same seeded base
    trained = {name[len("policy.") :]: value for name, value in state.items() if name.startswith("policy.")}
    assert trained.keys() == fresh.keys()
    assert all(torch.equal(trained[name], fresh[name]) for name in fresh if not _is_adapter(name))
    assert any(trained[name].any() for name in trained if "lora_B" in name)  # lora_B starts at zero

    exported = tmp_path / "runs/tiny/version_0/hf_policy"
    assert (exported / "adapter_config.json").exists() and not (exported / "model.safetensors").exists()
    reloaded = peft.PeftModel.from_pretrained(TinyQwen3(**TINY).load_model(tokenizer), exported)
    reloaded_state = reloaded.state_dict()
    assert all(torch.equal(reloaded_state[name], trained[name]) for name in trained if _is_adapter(name))
