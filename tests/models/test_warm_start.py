"""The supervised warm start: training, caching, cache keys, determinism."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from gspo_lightning.data import WarmStartedTinyQwen3
from gspo_lightning.models import WARM_START_VERSION, TinyQwen3, warm_start
from gspo_lightning.models.cache import REPORT_FILE
from gspo_lightning.models.supervised import training_batch


def tiny(tmp_path: Path, **overrides: Any) -> WarmStartedTinyQwen3:
    """A warm start small enough to train in about a second."""
    base = TinyQwen3(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, max_position_embeddings=16
    )
    settings: dict[str, Any] = {
        "base": base,
        "num_digits": 1,
        "max_steps": 30,
        "batch_size": 16,
        "lr": 3e-3,
        "target_accuracy": 1.0,
        "eval_every": 10,
        "eval_size": 16,
        "cache_dir": str(tmp_path),
    }
    return WarmStartedTinyQwen3(**{**settings, **overrides})


def count_training(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Wrap the training function to count its calls."""
    calls: list[int] = []
    real = warm_start.train_warm_start

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(warm_start, "train_warm_start", counting)
    return calls


def test_trains_once_then_uses_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_training(monkeypatch)
    loader = tiny(tmp_path)
    tokenizer = loader.load_tokenizer()
    first = loader.load_model(tokenizer)
    assert len(calls) == 1
    path = loader.cache_path()
    assert path.parent == tmp_path / "warm_start"
    report = json.loads((path / REPORT_FILE).read_text())
    assert report["steps"] == 30
    assert report["settings"] == loader.settings()
    assert [entry["step"] for entry in report["history"]] == [10, 20, 30]
    assert report["history"][-1]["loss"] < report["first_loss"]  # it learned something
    assert report["history"][-1]["loss"] < report["history"][0]["loss"]
    assert not report["reached_target"]
    assert [p.name for p in path.parent.iterdir() if p.is_dir()] == [path.name]  # no temp dir left

    second = tiny(tmp_path).load_model(tokenizer)
    assert len(calls) == 1  # served from the cache
    for key, value in first.state_dict().items():
        assert torch.equal(second.state_dict()[key], value)
    # the cache is a complete save_pretrained directory, tokenizer included
    assert (path / "tokenizer.json").is_file()


def test_stops_at_target_accuracy(tmp_path: Path) -> None:
    loader = tiny(tmp_path, target_accuracy=0.0)
    loader.load_model(loader.load_tokenizer())
    report = json.loads((loader.cache_path() / REPORT_FILE).read_text())
    assert report["steps"] == 10  # the first evaluation already meets a target of 0
    assert report["reached_target"]


def test_training_is_deterministic_and_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(5)
    expected_next = torch.rand(2)
    torch.manual_seed(5)
    model_a = tiny(tmp_path / "a", max_steps=10).load_model(tiny(tmp_path).load_tokenizer())
    assert torch.equal(torch.rand(2), expected_next)
    model_b = tiny(tmp_path / "b", max_steps=10).load_model(tiny(tmp_path).load_tokenizer())
    for key, value in model_a.state_dict().items():
        assert torch.equal(model_b.state_dict()[key], value)


def test_cache_key_covers_every_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = tiny(tmp_path).cache_path()
    assert tiny(tmp_path).cache_path() == reference
    assert tiny(tmp_path, seed=1).cache_path() != reference
    assert tiny(tmp_path, lr=1e-3).cache_path() != reference
    assert (
        tiny(
            tmp_path,
            base=TinyQwen3(hidden_size=32, num_layers=2, intermediate_size=64, max_position_embeddings=16, seed=1),
        ).cache_path()
        != reference
    )
    assert tiny(tmp_path, cache_dir=str(tmp_path / "other")).cache_path().name == reference.name
    monkeypatch.setattr(warm_start, "WARM_START_VERSION", WARM_START_VERSION + 1)
    assert tiny(tmp_path).cache_path() != reference


def test_cache_root_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GSPO_LIGHTNING_CACHE", str(tmp_path / "env"))
    assert tiny(tmp_path, cache_dir=None).cache_path().parent == tmp_path / "env" / "warm_start"
    monkeypatch.delenv("GSPO_LIGHTNING_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home" / ".cache" / "gspo_lightning" / "warm_start"
    assert tiny(tmp_path, cache_dir=None).cache_path().parent == expected


def test_concurrent_loads_train_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_training(monkeypatch)
    loader = tiny(tmp_path, max_steps=10)
    tokenizer = loader.load_tokenizer()
    errors: list[BaseException] = []

    def load() -> None:
        try:
            loader.load_model(tokenizer)
        except BaseException as error:  # surfaced in the main thread below
            errors.append(error)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(calls) == 1


def test_training_batch_masks_prompt_and_padding() -> None:
    tokenizer = TinyQwen3().load_tokenizer()
    problems = [{"question": "1+2", "answer": "3"}, {"question": "9+9", "answer": "18"}]
    batch = training_batch(tokenizer, problems, "{question}=")
    eos, ignore = tokenizer.eos_token_id, -100
    assert batch["input_ids"][0].tolist() == tokenizer.encode("1+2=3") + [eos, tokenizer.pad_token_id]
    assert batch["labels"][0].tolist() == [ignore] * 4 + tokenizer.encode("3") + [eos, ignore]
    assert batch["labels"][1].tolist() == [ignore] * 4 + tokenizer.encode("18") + [eos]
    assert batch["attention_mask"].tolist() == [[1] * 6 + [0], [1] * 7]


def test_validation() -> None:
    with pytest.raises(ValueError, match="target_accuracy"):
        WarmStartedTinyQwen3(target_accuracy=1.5)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        WarmStartedTinyQwen3(base=TinyQwen3(max_position_embeddings=8))
    with pytest.raises(ValueError, match="operations"):
        WarmStartedTinyQwen3(operations="/")


@pytest.mark.parametrize(
    ("loader", "data", "message"),
    [
        ({"num_digits": 3}, {"num_digits": 2}, r"model.init_args.policy.init_args.num_digits=3 but "
                                               r"data.init_args.source.init_args.num_digits=2"),
        ({"prompt_template": "{question} ="}, {}, r"policy.init_args.prompt_template=.\{question\} =. but "
                                                    r"data.init_args.prompt_template='\{question\}='"),
    ],
)  # fmt: skip
def test_a_warm_start_on_another_task_than_the_data_is_refused_before_it_trains(tmp_path, loader, data, message):
    import lightning.pytorch as pl

    from gspo_lightning import GroupSampler, GSPOModule
    from gspo_lightning.data import ArithmeticTask, PromptDataModule
    from gspo_lightning.rewards import ExactAnswer

    policy = WarmStartedTinyQwen3(cache_dir=str(tmp_path / "never"), **loader)
    datamodule = PromptDataModule(ArithmeticTask(**{"num_digits": 3, **data}), "{question}=", prompts_per_rollout=2)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, callbacks=[GroupSampler([ExactAnswer()], group_size=2)])  # fmt: skip
    with pytest.raises(ValueError, match=message):
        trainer.fit(GSPOModule(policy, max_new_tokens=256), datamodule=datamodule)
    assert not (tmp_path / "never").exists()  # refused before the warm start trained (and cached) anything
    WarmStartedTinyQwen3(num_digits=2).check_matches(ArithmeticTask(num_digits=2), "{question}=")  # equal: fine


def test_a_warm_start_trained_on_a_rank_other_than_0_is_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # Under DDP whichever rank takes the lock trains; transformers' save_pretrained writes nothing on rank != 0.
    real = warm_start.train_warm_start

    def then_save_as_rank_1(*args: Any, **kwargs: Any) -> Any:
        trained = real(*args, **kwargs)
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda *args, **kwargs: 1)
        return trained

    monkeypatch.setattr(warm_start, "train_warm_start", then_save_as_rank_1)
    loader = tiny(tmp_path, max_steps=10)
    tokenizer = loader.load_tokenizer()
    trained = loader.load_model(tokenizer)
    monkeypatch.undo()
    assert warm_start.is_complete(loader.cache_path())
    ids = torch.tensor([tokenizer("1+2=")["input_ids"]])
    reloaded = AutoModelForCausalLM.from_pretrained(loader.cache_path(), dtype=torch.float32)
    torch.testing.assert_close(reloaded(ids).logits, trained(ids).logits, rtol=0, atol=0)


def test_an_incomplete_cache_entry_is_trained_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loader = tiny(tmp_path, max_steps=10)
    path = loader.cache_path()
    path.mkdir(parents=True)
    (path / REPORT_FILE).write_text("{}")  # what an earlier version left when rank 1 trained: no model files
    calls = count_training(monkeypatch)
    loader.load_model(loader.load_tokenizer())
    assert len(calls) == 1 and warm_start.is_complete(path)


@pytest.mark.parametrize("terminal", [True, False])
def test_training_shows_its_progress_and_its_outcome(tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch,
                                                     terminal: bool) -> None:  # fmt: skip
    """A warm start takes minutes on a busy machine: it says what it trains towards, shows its steps and accuracy
    (on a terminal: in a log file the bar's redraws would pile up on one line), and how it ended."""
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    loader = tiny(tmp_path, max_steps=20)
    loader.load_model(loader.load_tokenizer())
    err = capsys.readouterr().err
    assert f"warm start: training the policy until 100% greedy accuracy (once; cached in {loader.cache_path()})" in err
    assert ("warm start: 100%|" in err and "20/20" in err) == terminal  # the bar, filled
    assert ("warm start:   0%|" in err) == terminal  # no redraw at all into a log file
    assert "after 20 steps" in err and "stopped at max_steps short of the target 100%" in err
    capsys.readouterr()
    loader.load_model(loader.load_tokenizer())  # cached: nothing to show
    assert "warm start" not in capsys.readouterr().err


def test_the_old_class_paths_of_the_task_warm_starts_still_load_with_a_warning():
    import gspo_lightning.data as data
    import gspo_lightning.models as models

    for name in ("WarmStartedTinyQwen3", "CountdownWarmStartedTinyQwen3", "ScratchpadWarmStartedTinyQwen3"):
        with pytest.warns(FutureWarning, match=rf"gspo_lightning.models.{name} moved to gspo_lightning.data.{name}"):
            assert getattr(models, name) is getattr(data, name)
    with pytest.raises(AttributeError):
        models.NoSuchLoader  # noqa: B018
