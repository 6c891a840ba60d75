"""What the command line shows: library notices silenced, the rich progress bar counting optimizer steps."""

from __future__ import annotations

import logging
import warnings

import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from gspo_lightning.console import StepProgressBar, quiet_library_noise


def test_library_notices_are_silenced_and_real_warnings_are_not(caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_library_noise()
        warnings.warn("'set_vital' is deprecated, please do not call", UserWarning)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
        warnings.warn("sampler.top_p is ignored here", UserWarning)  # a real one stays
    assert [str(w.message) for w in caught] == ["sampler.top_p is ignored here"]
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("💡 Tip: For seamless cloud logging ...")
        logger.info("GPU available: False, used: False")
    assert [record.getMessage() for record in caplog.records] == ["GPU available: False, used: False"]


class _ReadDescription(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar = trainer.progress_bar_callback
        task = next(t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id)
        self.seen.append((task.description, "v_num" in bar.get_metrics(trainer, pl_module)))


def test_the_rich_bar_counts_optimizer_steps_not_epochs(tmp_path):
    pytest.importorskip("rich")
    reader = _ReadDescription()
    trainer = Trainer(default_root_dir=tmp_path, max_steps=3, max_epochs=-1, callbacks=[StepProgressBar(), reader],
                      enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(BoringModel())
    assert reader.seen == [("optimizer steps", False)] * 3  # not "Epoch 0/-2"; no "v_num: 0.000"
