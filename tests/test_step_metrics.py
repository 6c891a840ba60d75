"""The orchestration side of the diagnostics: what training_step hands to Lightning's loggers."""

from __future__ import annotations

from dataclasses import replace
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


def test_asynchronous_minibatches_log_the_clip_fraction_against_the_behaviour_policy(tmp_path):
    """pi_theta = pi_old exactly (nothing clipped against the proximal policy), but the engine's stale
    log-probs sit 0.01 lower per token on the first response (A > 0): its s_i against them is exp(0.01) >
    1 + 4e-4, so it is clipped against the behaviour policy; the second (A < 0, same log-probs) is not."""
    module = RecordingModule(
        logged={}, objective=resolve_objective("gspo"), eps_low=3e-4, eps_high=4e-4,
        hparams=SimpleNamespace(max_new_tokens=8), global_step=0, loggers=[CSVLogger(tmp_path)],
    )
    logprobs, minibatch = _minibatch(torch.zeros(2, 2))
    engine = minibatch.old_logprobs - torch.tensor([[0.01], [0.0]])  # [n, R]
    minibatch = replace(minibatch, engine_logprobs=engine, policy_lag=torch.tensor([2, 1]))
    log_step_metrics(module, torch.tensor(0.5), {}, logprobs, minibatch, 0)

    assert module.logged["diag/clip_frac_resp"] == 0.0
    assert module.logged["diag/behaviour_clip_frac_resp"] == pytest.approx(0.5, abs=1e-7)
    assert module.logged["diag/behaviour_clip_frac_lag_2"] == 1.0 and module.logged["diag/behaviour_clip_frac_lag_1"] == 0.0


def test_synchronous_minibatches_log_the_behaviour_clip_fraction_without_lags(tmp_path):
    module = RecordingModule(
        logged={}, objective=resolve_objective("gspo"), eps_low=3e-4, eps_high=4e-4,
        hparams=SimpleNamespace(max_new_tokens=8), global_step=0, loggers=[CSVLogger(tmp_path)],
    )
    logprobs, minibatch = _minibatch(torch.zeros(2, 2))
    log_step_metrics(module, torch.tensor(0.5), {}, logprobs, minibatch, 0)
    assert not [name for name in module.logged if "behaviour" in name]  # no engine log-probs: nothing to compare

    log_step_metrics(module, torch.tensor(0.5), {}, logprobs, replace(minibatch, engine_logprobs=minibatch.old_logprobs), 0)
    assert module.logged["diag/behaviour_clip_frac_resp"] == 0.0
    assert not [name for name in module.logged if "behaviour" in name and "lag" in name]
