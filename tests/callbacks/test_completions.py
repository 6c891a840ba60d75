"""LogCompletions: the latest round's samples, with rewards and advantages, every N steps."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from gspo_lightning.callbacks import LogCompletions
from gspo_lightning.callbacks.completions import completion_rows, markdown_table
from gspo_lightning.rewards import ExactAnswer
from gspo_lightning.rollout import Rollout
from gspo_lightning.sampling import GroupSampler


def _rollout() -> Rollout:
    ids = torch.zeros(4, 2, dtype=torch.long)
    return Rollout(
        prompt_ids=ids, prompt_mask=ids, response_ids=ids, response_mask=ids,
        rewards=torch.tensor([1.0, 0.0, 0.5, 0.5]), advantages=torch.tensor([0.7, -0.7, 0.0, 0.0]),
        truncated=torch.zeros(4, dtype=torch.bool), completions=["12", "13 | x", "4", "y" * 50],
        prompts=["5+7=", "5+7=", [{"role": "user", "content": "2+2?"}]] * 1 + ["2+2?"],
        reward_components={"ExactAnswer": torch.tensor([1.0, 0.0, 0.5, 0.5])},
    )  # fmt: skip


def test_rows_hold_prompt_completion_each_reward_and_the_advantage():
    rows = completion_rows(_rollout(), max_rows=3, max_chars=10)
    assert rows[0] == {"prompt": "5+7=", "completion": "12", "reward/ExactAnswer": 1.0, "reward": 1.0,
                       "advantage": pytest.approx(0.7)}  # fmt: skip
    assert rows[2]["prompt"] == "user: 2+2?" and len(rows) == 3
    assert completion_rows(_rollout(), 4, 10)[3]["completion"] == "y" * 10 + "..."
    table = markdown_table(rows).splitlines()
    assert table[0] == "| prompt | completion | reward/ExactAnswer | reward | advantage |"
    assert "13 \\| x" in table[3]  # a | in a completion does not break the table


def _trainer(tmp_path, sampler, step: int):
    return SimpleNamespace(callbacks=[sampler], global_step=step, log_dir=str(tmp_path), default_root_dir=str(tmp_path),
                           is_global_zero=True, loggers=[])  # fmt: skip


def test_a_round_is_logged_at_its_first_step_at_or_after_each_multiple(tmp_path):
    sampler = GroupSampler(rewards=[ExactAnswer()], group_size=2, num_minibatches=2)
    sampler.last_rollout = _rollout()
    callback = LogCompletions(every_n_steps=3, max_rows=2)
    for step in range(8):  # K = 2: rounds start at steps 0, 2, 4, 6
        batch = SimpleNamespace(minibatch_index=step % 2)
        callback.on_train_batch_end(_trainer(tmp_path, sampler, step + 1), None, None, batch, step)
    logged = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert sorted({row["step"] for row in logged}) == [0, 4, 6]  # multiples 0, 3, 6: rounds at 0, 4 and 6
    assert len(logged) == 6 and logged[0]["completion"] == "12"
    restored = LogCompletions(every_n_steps=3)
    restored.load_state_dict(callback.state_dict())
    assert restored.state_dict() == {"next_step": 9}


def test_bad_settings_name_the_setting():
    with pytest.raises(ValueError, match=r"completions.every_n_steps must be an integer >= 0"):
        LogCompletions(every_n_steps=-1)
    with pytest.raises(ValueError, match=r"completions.max_rows must be >= 1"):
        LogCompletions(max_rows=0)
