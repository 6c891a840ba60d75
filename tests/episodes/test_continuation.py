"""Continuing trajectories (episodes/loop.py): one left-padded engine call, each row's new tokens to its EOS."""

from __future__ import annotations

import torch

from gspo_lightning.engines.base import EngineSamples, SamplingEngine, SamplingSettings
from gspo_lightning.episodes.loop import EpisodeRun, EpisodeState, _continue, new_tokens

EOS, PAD = 2, 0


def test_new_tokens_stop_after_the_first_eos_and_within_the_room():
    assert new_tokens([5, 6, EOS, PAD, PAD], EOS, room=8) == [5, 6, EOS]
    assert new_tokens([5, 6, EOS, 7, EOS], EOS, room=8) == [5, 6, EOS]
    assert new_tokens([5, 6, 7, 8], EOS, room=2) == [5, 6]
    assert new_tokens([5, PAD, 7], EOS, room=8) == [5, PAD, 7]  # no EOS: every token was sampled, a pad id too


class _Recorder(SamplingEngine):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def sample(self, policy, tokenizer, prompt_ids, prompt_mask, settings, group_size, with_logprobs=False,
               synced_gpus=False, seed=0, with_routes=False):  # fmt: skip
        self.calls.append((prompt_ids.tolist(), prompt_mask.tolist(), settings, group_size, with_logprobs, seed))
        rows = prompt_ids.shape[0]
        return EngineSamples(torch.full((rows, 1), EOS), torch.ones(rows, dtype=torch.bool))


class _Tokenizer:
    pad_token_id = PAD


def _run(engine, max_new_tokens: int, with_logprobs: bool = False) -> EpisodeRun:
    return EpisodeRun(engine, None, _Tokenizer(), SamplingSettings(max_new_tokens), None, 1, None,
                      with_logprobs=with_logprobs)  # fmt: skip


def test_the_histories_are_left_padded_into_one_call_of_one_continuation_each():
    engine = _Recorder()
    run = _run(engine, 4, with_logprobs=True)
    _continue(run, [EpisodeState(None, [], [7, 8, 9]), EpisodeState(None, [], [5])], 1, seed=11, chunk=None)
    assert engine.calls == [([[7, 8, 9], [PAD, PAD, 5]], [[1, 1, 1], [0, 0, 1]], run.sampling, 1, True, 11)]


def test_a_call_asks_for_the_roomiest_states_tokens_within_the_chunk():
    engine = _Recorder()
    started = EpisodeState(None, [], [7], turn_tokens=3)  # 3 of its turn's 4 tokens taken: 1 left
    _continue(_run(engine, 4), [started, EpisodeState(None, [], [5])], 2, seed=0, chunk=3)
    assert engine.calls[0][2] == SamplingSettings(3) and engine.calls[0][3] == 2


def test_no_history_still_makes_the_call_with_one_pad_token():
    engine = _Recorder()
    _continue(_run(engine, 1), [], 1, seed=0, chunk=None)
    assert engine.calls[0][:2] == ([[PAD]], [[1]])
