"""PromptDataModule and PromptLoader: settings, held-out batches, and exact resume under Lightning."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import datasets
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader

from gspo_lightning.data import ArithmeticTask, PromptDataModule, PromptFormatter, PromptSource
from gspo_lightning.data.datamodule import PromptLoader
from gspo_lightning.data.stream import PromptStream
from gspo_lightning.rollout.types import PromptBatch

Seen = tuple[int, int, list[Any]]


class TableSource(PromptSource):
    """Numbered rows ``q0, q1, ...`` so tests can read positions off the prompts."""

    def __init__(self, train: int = 12, evaluation: int = 10) -> None:
        self.sizes = {"train": train, "eval": evaluation}

    def load(self) -> datasets.DatasetDict:
        return datasets.DatasetDict(
            {
                split: datasets.Dataset.from_list([{"question": f"{split}{i}", "answer": str(i)} for i in range(n)])
                for split, n in self.sizes.items()
            }
        )


def module(source: PromptSource | None = None, **kwargs: Any) -> PromptDataModule:
    settings = {"prompts_per_rollout": 4, "minibatches_per_rollout": 2, "eval_batch_size": 3} | kwargs
    return PromptDataModule(source or TableSource(), **settings)


def attach(datamodule: PromptDataModule, rank: int, world_size: int) -> PromptDataModule:
    """Set up as rank ``rank`` of ``world_size`` (a stand-in for the attributes a Trainer provides)."""
    trainer = SimpleNamespace(global_rank=rank, world_size=world_size, training=True)
    datamodule.trainer = trainer  # type: ignore[assignment]
    datamodule.setup("fit")
    return datamodule


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompts_per_rollout": 0}, "prompts_per_rollout must be a positive integer"),
        ({"minibatches_per_rollout": -1}, "minibatches_per_rollout"),
        ({"eval_batch_size": 0}, "eval_batch_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"system_prompt": "Be brief."}, "chat=True"),
        ({"prompt_template": "{}"}, "positional field"),
    ],
)
def test_bad_settings_fail_in_init(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        module(**kwargs)


def test_source_must_be_a_prompt_source() -> None:
    with pytest.raises(TypeError, match="PromptSource"):
        PromptDataModule("path/to/data.jsonl")  # type: ignore[arg-type]


def test_setup_checks_template_columns_and_rank_share() -> None:
    with pytest.raises(ValueError, match="'train' split"):
        module(prompt_template="{problem}").setup("fit")
    with pytest.raises(ValueError, match="prompts_per_rollout=4"):
        attach(module(source=TableSource(train=12)), rank=0, world_size=4)


def test_train_dataloader_serves_prompt_batches_with_every_column() -> None:
    datamodule = module(chat_template=True, system_prompt="sys")
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    assert isinstance(loader, StatefulDataLoader)
    batch = next(iter(loader))
    assert isinstance(batch, PromptBatch) and len(batch) == 4 and batch.num_minibatches == 2
    assert batch.prompts[0][0] == {"role": "system", "content": "sys"}
    assert sorted(batch.columns) == ["answer", "question"]  # rewards may need the raw question too


def test_heldout_batches_per_rank_in_order() -> None:
    served = []
    for rank in range(2):
        datamodule = attach(module(source=TableSource(evaluation=10)), rank=rank, world_size=2)
        batches = list(datamodule.heldout_dataloader())
        assert datamodule.heldout_size == 5
        assert [len(b) for b in batches] == [3, 2]
        assert all(b.minibatch_index == 0 and b.num_minibatches == 1 for b in batches)
        served.append(sum((b.prompts for b in batches), []))
    assert served == [[f"eval{i}" for i in range(0, 10, 2)], [f"eval{i}" for i in range(1, 10, 2)]]


def test_heldout_needs_setup() -> None:
    with pytest.raises(RuntimeError, match="setup"):
        module().heldout_dataloader()


def test_prompt_batches_reach_the_device_as_they_are_and_other_batches_move() -> None:
    datamodule = module()
    batch = PromptBatch(["q0=", "q1="], {"answer": [torch.tensor(0), torch.tensor(1)]}, 0, 0, 2)
    # Nothing in a prompt batch lives on a device: the same object comes back, columns untouched.
    assert datamodule.transfer_batch_to_device(batch, torch.device("meta"), 0) is batch
    assert batch.columns["answer"][0].device.type == "cpu"
    moved = datamodule.transfer_batch_to_device({"x": torch.zeros(2)}, torch.device("meta"), 0)
    assert moved["x"].device.type == "meta"


def loader_keys(loader: PromptLoader, count: int) -> list[Seen]:
    return [(b.rollout_index, b.minibatch_index, b.prompts) for b in itertools.islice(iter(loader), count)]


def new_stream() -> PromptStream:
    return PromptStream(TableSource(train=12).load()["train"], PromptFormatter(), 4, 2)


def test_loader_state_follows_yielded_or_used_batches() -> None:
    reference = loader_keys(PromptLoader(new_stream()), 10)
    plain = PromptLoader(new_stream())
    assert loader_keys(plain, 3) == reference[:3]
    restored = PromptLoader(new_stream())
    restored.load_state_dict(plain.state_dict())
    assert loader_keys(restored, 7) == reference[3:]

    # A consumer that fetches ahead: only batches it marks used move the saved position.
    ahead = PromptLoader(new_stream(), advance_on="use")
    iterator = iter(ahead)
    used = next(iterator)
    next(iterator)  # fetched but never used
    ahead.mark_used(used)
    restored = PromptLoader(new_stream())
    restored.load_state_dict(ahead.state_dict())
    assert loader_keys(restored, 9) == reference[1:]


def test_worker_processes_serve_the_same_items_in_order() -> None:
    reference = loader_keys(PromptLoader(new_stream()), 10)
    parallel = PromptLoader(new_stream(), num_workers=2)
    assert loader_keys(parallel, 5) == reference[:5]
    restored = PromptLoader(new_stream(), num_workers=2)
    restored.load_state_dict(parallel.state_dict())
    assert loader_keys(restored, 5) == reference[5:]


class Recorder(LightningModule):
    """Records what each training step was served."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[Seen] = []

    def training_step(self, batch: PromptBatch, batch_idx: int) -> torch.Tensor:
        self.seen.append((batch.rollout_index, batch.minibatch_index, list(batch.prompts)))
        return self.layer(torch.ones(1, 1)).pow(2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(directory: Path, max_steps: int, ckpt_path: Path | None = None) -> list[Seen]:
    # 12 rows, P=4: 3 rollouts per epoch; K=2: 6 steps per epoch, so 10 steps cross an epoch boundary.
    datamodule = PromptDataModule(
        ArithmeticTask(train_size=12, eval_size=4), prompts_per_rollout=4, minibatches_per_rollout=2
    )
    checkpoints = ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_last=True, save_top_k=-1)
    trainer = Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        callbacks=[checkpoints],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=directory,
    )
    model = Recorder()
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    return model.seen


def test_lightning_resume_serves_exactly_the_batches_of_an_uninterrupted_run(tmp_path: Path) -> None:
    first = fit(tmp_path / "first", max_steps=6)
    step3 = tmp_path / "first" / "epoch=0-step=3.ckpt"
    saved = torch.load(step3, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    # Three batches trained (items 0-2), so the next one is item 3 = rollout 1, minibatch 1 (Lightning had
    # already fetched item 4 when it saved).
    assert (saved["stream"]["rollout_index"], saved["stream"]["minibatch_index"]) == (1, 1)

    resumed = fit(tmp_path / "resumed", max_steps=10, ckpt_path=step3)
    reference = fit(tmp_path / "reference", max_steps=10)
    assert [(r, k) for r, k, _ in reference] == [(i // 2, i % 2) for i in range(10)]
    assert reference[:6] == first
    assert resumed[:3] == first[3:6]
    assert resumed == reference[3:]
