"""Sampling follows the configured distribution, never the checkpoint's ``generation_config.json``.

A hub checkpoint ships sampling defaults (Qwen2.5-Instruct a repetition penalty, Qwen3 its own temperature, top_k
and top_p) that ``generate`` applies to every field our config leaves unset. The checkpoint below sets each of
them; the scores ``generate`` samples from must still be exactly softmax(logits / T).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from gspo_lightning.engines.base import SamplingSettings
from gspo_lightning.engines.hf import generate_groups, generate_responses
from gspo_lightning.models import Pretrained, TinyQwen3
from gspo_lightning.models.char_tokenizer import ASCII_ALPHABET
from gspo_lightning.rollout.pipeline import encode_prompts
from tests.conftest import TINY


@pytest.fixture(scope="module")
def opinionated_checkpoint(tmp_path_factory):
    """A local checkpoint whose generation config sets every logits processor and stopping rule it can."""
    loader = TinyQwen3(**TINY, alphabet=ASCII_ALPHABET)
    tokenizer = loader.load_tokenizer()
    torch.manual_seed(0)
    model = loader.load_model(tokenizer)
    token = tokenizer.convert_tokens_to_ids
    model.generation_config = GenerationConfig(
        do_sample=True,
        temperature=0.6,
        top_k=20,
        top_p=0.95,
        min_p=0.05,
        typical_p=0.9,
        repetition_penalty=1.5,
        no_repeat_ngram_size=2,
        min_new_tokens=5,
        suppress_tokens=[token("a"), token("b")],
        begin_suppress_tokens=[token("c")],
        bad_words_ids=[[token("d")]],
        sequence_bias={(token("e"),): 5.0},
        forced_eos_token_id=tokenizer.eos_token_id,
        eos_token_id=[tokenizer.eos_token_id, token("f")],
        pad_token_id=tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("opinionated")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _scores_and_logits(policy, tokenizer, settings: SamplingSettings):
    ids, mask = encode_prompts(tokenizer, ["hello ", "1+1="], "cpu")
    config = settings.generation_config(tokenizer)
    config.return_dict_in_generate, config.output_scores, config.output_logits = True, True, True
    torch.manual_seed(0)
    output = generate_groups(policy, ids, mask, config, group_size=4)
    return torch.stack(output.scores, 1), torch.stack(output.logits, 1)  # [N, R, V] each: processed, raw


def test_the_checkpoint_generation_config_really_sets_every_processor(opinionated_checkpoint):
    saved = GenerationConfig.from_pretrained(opinionated_checkpoint)
    assert (saved.repetition_penalty, saved.temperature, saved.top_k, saved.min_new_tokens) == (1.5, 0.6, 20, 5)
    assert saved.suppress_tokens and saved.bad_words_ids and saved.sequence_bias


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_samples_come_from_softmax_of_logits_over_temperature(opinionated_checkpoint, temperature):
    loader = Pretrained(str(opinionated_checkpoint))
    tokenizer = loader.load_tokenizer()
    policy = loader.load_model(tokenizer).eval()
    scores, logits = _scores_and_logits(policy, tokenizer, SamplingSettings(16, temperature=temperature))
    # Every position a response reached: the distribution sampled from is exactly log softmax(logits / T).
    torch.testing.assert_close(
        torch.log_softmax(scores, -1), torch.log_softmax(logits / temperature, -1), rtol=0, atol=1e-6
    )
    assert policy.generation_config.repetition_penalty == 1.5  # put back: an export keeps the checkpoint's


def test_greedy_evaluation_takes_the_argmax_of_the_raw_logits(opinionated_checkpoint):
    loader = Pretrained(str(opinionated_checkpoint))
    tokenizer = loader.load_tokenizer()
    policy = loader.load_model(tokenizer).eval()
    scores, logits = _scores_and_logits(policy, tokenizer, SamplingSettings(16, temperature=0.0))
    torch.testing.assert_close(scores, logits, rtol=0, atol=0)


def test_generation_stops_at_the_tokenizers_eos_only(opinionated_checkpoint):
    """The checkpoint's second EOS id would end responses that the response mask then treats as unfinished."""
    loader = Pretrained(str(opinionated_checkpoint))
    tokenizer = loader.load_tokenizer()
    policy = loader.load_model(tokenizer).eval()
    ids, mask = encode_prompts(tokenizer, ["ffff"] * 64, "cpu")
    torch.manual_seed(0)
    responses = generate_responses(policy, tokenizer, ids, mask, SamplingSettings(12, temperature=3.0))  # [N, R]
    f, eos = tokenizer.convert_tokens_to_ids("f"), tokenizer.eos_token_id
    continued = 0
    for row in responses.tolist():
        ended = row.index(eos) if eos in row else len(row)
        continued += sum(1 for j, t in enumerate(row[: ended - 1]) if t == f)  # an "f" with a token after it
    assert continued > 0  # an "f" did not end its response: only the tokenizer's EOS does


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_sampling_warns_about_nothing(opinionated_checkpoint, temperature):
    """Every ``generate`` call used to log transformers' "Both `min_new_tokens` (=0) and `min_length` (=0) seem to
    have been set" (18 times in a 40-step quick start): the neutral settings must not contradict each other."""
    import logging
    import warnings

    from gspo_lightning.engines import HFEngine

    loader = Pretrained(str(opinionated_checkpoint))  # a checkpoint that sets min_new_tokens itself
    tokenizer = loader.load_tokenizer()
    policy = loader.load_model(tokenizer).eval()
    ids, mask = encode_prompts(tokenizer, ["hello ", "1+1="], "cpu")
    records: list[logging.LogRecord] = []
    recorder = logging.Handler(logging.INFO)
    recorder.emit = records.append
    logging.getLogger("transformers").addHandler(recorder)  # transformers' loggers do not propagate to the root
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            HFEngine().sample(policy, tokenizer, ids, mask, SamplingSettings(8, temperature=temperature), 2)
    finally:
        logging.getLogger("transformers").removeHandler(recorder)
    assert [record.getMessage() for record in records if record.levelno >= logging.WARNING] == []
    assert [str(warning.message) for warning in warned] == []
