import pytest
import torch

from gspo_lightning.objectives import grpo_loss, gspo_loss
from tests.objectives.helpers import make_batch

LOSSES = [gspo_loss, grpo_loss]


@pytest.mark.parametrize("loss_fn", LOSSES)
@pytest.mark.parametrize(
    ("eps_low", "eps_high", "message"),
    [(0.0, 0.2, "eps_low"), (-0.1, 0.2, "eps_low"), (0.2, 1.0, "eps_high"), (0.2, float("nan"), "eps_high")],
)
def test_clip_range_is_validated(loss_fn, eps_low: float, eps_high: float, message: str) -> None:
    logprobs, old, mask = make_batch([[0.1]], length=2)
    with pytest.raises(ValueError, match=rf"{message} must satisfy 0 < {message} < 1, got {message}="):
        loss_fn(logprobs, old, torch.tensor([1.0]), mask, eps_low, eps_high)


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_shapes_are_validated(loss_fn) -> None:
    logprobs, old, mask = make_batch([[0.1], [0.2]], length=2)
    with pytest.raises(ValueError, match=r"advantages must be \[N\]"):
        loss_fn(logprobs, old, torch.tensor([1.0]), mask, 0.2, 0.2)
    with pytest.raises(ValueError, match=r"mask must have the shape of logprobs"):
        loss_fn(logprobs, old, torch.tensor([1.0, 1.0]), mask[:, :1], 0.2, 0.2)
    with pytest.raises(ValueError, match=r"logprobs must be \[N, T\]"):
        loss_fn(logprobs[0], old[0], torch.tensor([1.0]), mask[0], 0.2, 0.2)
    with pytest.raises(ValueError, match=r"old_logprobs must have the shape of logprobs"):
        loss_fn(logprobs, old[:1], torch.tensor([1.0, 1.0]), mask, 0.2, 0.2)
