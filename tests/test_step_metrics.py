"""The orchestration side of the diagnostics: what training_step hands to Lightning's loggers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from gspo_lightning.objectives import resolve_objective
from gspo_lightning.rollout.types import Minibatch
from gspo_lightning.step_metrics import log_step_metrics


class RecordingModule(SimpleNamespace):
    """Just what log_step_metrics uses of a LightningModule, recording what it logs."""

    def log(self, name, value, **kwargs):
        self.logged[name] = value

    def log_dict(self, values, **kwargs):
        self.logged.update(values)


def _minibatch(log_ratios: torch.Tensor) -> tuple[torch.Tensor, Minibatch]:
    old = torch.full_like(log_ratios, -1.0)  # [n, R]
    mask = torch.ones_like(log_ratios, dtype=torch.long)
    ids = torch.zeros_like(mask)
    return old + log_ratios, Minibatch(ids, mask, ids, mask, old, torch.tensor([1.0, -1.0]), torch.zeros(2))


@pytest.mark.parametrize("minibatch_index", [0, 3])
def test_drift_is_logged_per_minibatch_index_and_histograms_reach_tensorboard(tmp_path, minibatch_index):
    tensorboard = TensorBoardLogger(tmp_path)
    histograms = []
    tensorboard.experiment.add_histogram = lambda tag, values, step: histograms.append((tag, values, step))
    module = RecordingModule(
        logged={}, objective=resolve_objective("gspo"), eps_low=3e-4, eps_high=4e-4,
        hparams=SimpleNamespace(max_new_tokens=8), global_step=7, loggers=[CSVLogger(tmp_path), tensorboard],
    )
    logprobs, minibatch = _minibatch(torch.tensor([[0.01, 0.03], [0.0, 0.0]]))
    log_step_metrics(module, torch.tensor(0.5), {"clip_frac": torch.tensor(0.5)}, logprobs, minibatch, minibatch_index)

    kl = module.logged["diag/kl_old_theta"]
    assert module.logged[f"drift/kl_old_theta_mb{minibatch_index}"] is kl and kl > 0
    # the other indices' series get no entry at this step: a value or nothing, never a NaN placeholder
    assert [name for name in module.logged if name.startswith("drift/")] == [f"drift/kl_old_theta_mb{minibatch_index}"]
    assert module.logged["train/clip_frac"] == 0.5 and "diag/clip_frac_resp_high" in module.logged
    ((tag, values, step),) = histograms
    assert tag == "diag/seq_ratio" and step == 7
    torch.testing.assert_close(values, torch.tensor([0.02, 0.0]).exp())  # s_i = exp(mean token log-ratio)
