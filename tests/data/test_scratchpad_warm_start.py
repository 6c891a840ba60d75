"""The scratchpad warm start: room for the longest response, the final-answer check, the task match."""

from __future__ import annotations

import pytest

from gspo_lightning.data import ScratchpadAdditionTask
from gspo_lightning.data.scratchpad import SCRATCHPAD_ALPHABET, scratchpad_length
from gspo_lightning.data import ScratchpadWarmStartedTinyQwen3
from gspo_lightning.models import TinyQwen3
from gspo_lightning.models.supervised import evaluate_accuracy, training_batch


def test_the_default_model_has_room_for_the_prompt_the_longest_response_and_eos():
    loader = ScratchpadWarmStartedTinyQwen3(num_digits=8)
    assert loader.base.alphabet == SCRATCHPAD_ALPHABET
    assert loader.base.max_position_embeddings == 2 * 8 + 2 + scratchpad_length(8) + 2


def test_a_model_too_short_for_the_response_is_refused():
    with pytest.raises(ValueError, match="do not fit base.max_position_embeddings=64"):
        ScratchpadWarmStartedTinyQwen3(num_digits=5, base=TinyQwen3(alphabet=SCRATCHPAD_ALPHABET))


def test_demonstrations_teach_the_working_and_correctness_checks_the_final_answer():
    loader = ScratchpadWarmStartedTinyQwen3(num_digits=3)
    demo = next(loader.demonstrations(1, seed=0))
    assert demo["answer"].endswith("=" + demo["result"]) and "," in demo["answer"]
    assert loader.is_correct(demo, demo["answer"])
    assert loader.is_correct(demo, "wrong working=" + demo["result"])
    assert not loader.is_correct(demo, demo["result"])  # the final answer comes after "="
    batch = training_batch(loader.load_tokenizer(), [demo], loader.prompt_template)
    assert int((batch["labels"] != -100).sum()) == len(demo["answer"]) + 1  # the working, the answer and eos


def test_the_warm_start_must_match_the_task_rl_trains_on():
    loader = ScratchpadWarmStartedTinyQwen3(num_digits=5)
    loader.check_matches(ScratchpadAdditionTask(num_digits=5), "{question}=")
    with pytest.raises(ValueError, match="num_digits=5 but data.init_args.source.init_args.num_digits=6"):
        loader.check_matches(ScratchpadAdditionTask(num_digits=6), "{question}=")


def test_an_untrained_model_is_scored_on_its_generated_final_answers():
    loader = ScratchpadWarmStartedTinyQwen3(num_digits=3, eval_size=4)
    tokenizer = loader.load_tokenizer()
    problems = list(loader.demonstrations(4, seed=1))
    assert evaluate_accuracy(loader.base.load_model(tokenizer), tokenizer, problems, loader) == 0.0
