"""DAPO's dynamic sampling and overlong masking: only informative groups train, the main prompt stream is
untouched, the extra prompts' stream resumes, and truncated responses leave the loss."""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import torch

from gspo_lightning import GroupSampler, GSPOModule
from gspo_lightning.data import ArithmeticTask, PromptDataModule
from gspo_lightning.models import TinyQwen3
from gspo_lightning.rollout.dynamic_sampling import choose_groups, concat_rollouts, informative_groups, select_groups
from gspo_lightning.rollout.types import Rollout
from tests.conftest import TINY

G = 4


def odd_prompts_teach_nothing(prompts, completions, **columns):
    """Every response to a prompt starting with an odd digit scores 0 (its group has no signal); others by length."""
    return [0.0 if int(p[0]) % 2 else len(c) / 8 for p, c in zip(prompts, completions, strict=True)]


def test_informative_groups_and_the_choice_of_groups():
    rewards = torch.tensor([0, 0, 0, 0, 1, 0, 1, 0, float("nan"), 1, 0, 1, 2, 2, 2, 3.0])
    flags = informative_groups(rewards, G)
    assert flags.tolist() == [False, True, False, True]  # equal rewards, varied, a NaN (skipped), varied
    assert choose_groups(flags, 3).tolist() == [1, 3, 0]  # the informative first, then padding


def _rollout(prompt_width: int, response_width: int, rows: int, value: float) -> Rollout:
    full = lambda width: torch.full((rows, width), value)  # noqa: E731
    return Rollout(full(prompt_width).long(), torch.ones(rows, prompt_width).long(), full(response_width).long(),
                   torch.ones(rows, response_width).long(), torch.arange(rows).float(), torch.zeros(rows),
                   torch.zeros(rows, dtype=torch.bool), [f"c{value}"] * rows, prompt_cut=torch.zeros(rows, dtype=torch.bool))  # fmt: skip


def test_rollouts_of_different_widths_join_with_the_right_padding():
    joined = concat_rollouts([_rollout(3, 2, 4, 7), _rollout(5, 4, 4, 9)], pad_token_id=0)
    assert joined.prompt_ids.shape == (8, 5) and joined.response_ids.shape == (8, 4)
    assert joined.prompt_ids[0].tolist() == [0, 0, 7, 7, 7] and joined.prompt_mask[0].tolist() == [0, 0, 1, 1, 1]
    assert joined.response_ids[0].tolist() == [7, 7, 0, 0] and joined.response_mask[0].tolist() == [1, 1, 0, 0]
    assert joined.completions == ["c7"] * 4 + ["c9"] * 4
    second = select_groups(joined, torch.tensor([1]), G)
    assert second.response_ids.tolist() == [[9] * 4] * 4 and second.rewards.tolist() == [0.0, 1.0, 2.0, 3.0]


def _fit(tmp_path, steps: int, **sampler_options) -> tuple[GroupSampler, PromptDataModule, list]:
    torch.manual_seed(0)
    module = GSPOModule(TinyQwen3(**TINY), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), max_new_tokens=6)
    data = PromptDataModule(ArithmeticTask(num_digits=2, train_size=64, eval_size=8), "{question}=",
                            prompts_per_rollout=4, minibatches_per_rollout=2)  # fmt: skip
    sampler = GroupSampler(rewards=[odd_prompts_teach_nothing], group_size=G, num_minibatches=2,
                           **sampler_options)  # fmt: skip
    rounds = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch.minibatch_index == 0:
                rounds.append((list(batch.prompts), dict(trainer.callback_metrics),
                               torch.cat([mb.rewards for mb in sampler._minibatches])))  # fmt: skip

    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                         callbacks=[sampler, Record()])  # fmt: skip
    trainer.fit(module, data)
    return sampler, data, rounds


def test_every_group_of_a_round_teaches_and_the_main_stream_is_untouched(tmp_path):
    _, _, plain = _fit(tmp_path, 4)
    _, data, dynamic = _fit(tmp_path, 4, dynamic_sampling=True, max_extra_draws=8)
    assert [prompts for prompts, _, _ in dynamic] == [prompts for prompts, _, _ in plain]  # the same main stream
    for _, metrics, rewards in dynamic:
        assert informative_groups(rewards, G).all()  # every trained group has a learning signal
        assert metrics["rollout/groups_kept"] == 4 and metrics["rollout/extra_draws"] >= 1
        assert metrics["rollout/groups_drawn"] == 4 * (1 + metrics["rollout/extra_draws"])
        assert metrics["rollout/groups_dropped"] >= 1
    assert data.state_dict()["refill"]["rollout_index"] >= 2  # the extra prompts came from the second stream


def test_past_the_cap_the_round_trains_on_what_there_is(tmp_path):
    _, _, rounds = _fit(tmp_path, 2, dynamic_sampling=True, max_extra_draws=0)
    (_, metrics, rewards), = rounds
    assert metrics["rollout/extra_draws"] == 0 and metrics["rollout/groups_kept"] < 4
    assert len(rewards) == 4 * G  # the batch keeps its shape


def test_the_extra_prompt_stream_resumes_where_it_stopped():
    data = PromptDataModule(ArithmeticTask(num_digits=2, train_size=64, eval_size=8), "{question}=",
                            prompts_per_rollout=4)  # fmt: skip
    data.setup("fit")
    data.draw_prompts()
    state = data.state_dict()
    expected = data.draw_prompts().prompts
    restored = PromptDataModule(ArithmeticTask(num_digits=2, train_size=64, eval_size=8), "{question}=",
                                prompts_per_rollout=4)  # fmt: skip
    restored.setup("fit")
    restored.load_state_dict(state)
    assert restored.draw_prompts().prompts == expected


def test_truncated_responses_leave_the_loss(tmp_path):
    sampler, _, rounds = _fit(tmp_path, 2, mask_truncated=True)
    truncated = torch.cat([mb.response_mask.sum(-1) == 0 for mb in sampler._minibatches])  # [N] masked out
    (_, metrics, _), = rounds
    assert metrics["rollout/truncated_masked"] == truncated.sum() > 0
