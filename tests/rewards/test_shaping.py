"""FormatReward and LengthPenalty, hand-computed."""

from __future__ import annotations

import pytest

from gspo_lightning.rewards.shaping import FormatReward, LengthPenalty


def test_format_reward() -> None:
    reward = FormatReward(r"Answer: \d+")
    completions = ["Answer: 42", "  Answer: 42\n", "Answer: 42 extra", "answer: 42", "", None]
    assert reward(["p"] * 6, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert FormatReward(r"(?s)<think>.*</think>\s*\d+")(["p"], ["<think>a\nb</think>\n7"]) == [1.0]


def test_format_reward_bad_pattern() -> None:
    with pytest.raises(ValueError, match="not a valid regular expression"):
        FormatReward("(")
    with pytest.raises(TypeError, match="must be a str"):
        FormatReward(3)


def test_length_penalty_in_characters() -> None:
    penalty = LengthPenalty(max_tokens_soft=10, max_tokens_hard=20, unit="characters")
    completions = ["", "x" * 10, "x" * 11, "x" * 15, "x" * 19, "x" * 20, "x" * 500, None]
    assert penalty(["p"] * 8, completions) == pytest.approx([0.0, 0.0, -0.1, -0.5, -0.9, -1.0, -1.0, -1.0])
    assert LengthPenalty(0, 4, unit="characters")(["p"], ["ab"]) == [-0.5]


def test_length_penalty_counts_the_policys_tokens(tokenizer) -> None:
    """With a tokenizer whose tokens are not characters, the count is the tokens'."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    word_tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    penalty = LengthPenalty(max_tokens_soft=2, max_tokens_hard=4)
    with pytest.raises(RuntimeError, match=r"has no tokenizer: GroupSampler hands it over at fit start"):
        penalty(["p"], ["hello world"])
    penalty.setup(word_tokenizer)
    # 11 characters but 2 tokens: no penalty; 3 tokens: -0.5
    assert penalty(["p"] * 2, ["hello world", "hello world hello"]) == pytest.approx([0.0, -0.5])


def test_the_sampler_hands_its_rewards_the_policys_tokenizer(policy, tokenizer) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from gspo_lightning.sampling import GroupSampler
    from tests.rollout.test_sampler import ReinforceModule, _prompt_batches

    penalty = LengthPenalty(1, 4)
    sampler = GroupSampler(rewards=[penalty], group_size=2, num_minibatches=1)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", callbacks=[sampler], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(ReinforceModule(policy, tokenizer, max_new_tokens=3), DataLoader(_prompt_batches(1, 1), batch_size=None,
                                                               collate_fn=lambda b: b))  # fmt: skip
    assert penalty.tokenizer is tokenizer


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((-1, 10), ValueError, "max_tokens_soft must be >= 0"),
        ((10, 10), ValueError, "must be greater than max_tokens_soft"),
        ((10, 5), ValueError, "must be greater than max_tokens_soft"),
        ((1.5, 10), TypeError, "max_tokens_soft must be an int"),
        ((1, True), TypeError, "max_tokens_hard must be an int"),
    ],
)
def test_length_penalty_validation(args, error, message) -> None:
    with pytest.raises(error, match=message):
        LengthPenalty(*args)
    with pytest.raises(ValueError, match=r"LengthPenalty.unit must be one of \['tokens', 'characters'\]"):
        LengthPenalty(1, 2, unit="bytes")
