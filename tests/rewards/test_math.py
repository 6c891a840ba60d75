"""MathAnswer: math-verify answer checking on hand-written cases, gold formats, threads and bad settings."""

from __future__ import annotations

import csv
import pickle
import shutil
import threading
from pathlib import Path

import pytest

from gspo_lightning.rewards import MathAnswer
from gspo_lightning.rewards.math import GoldAnswerError, detect_gold_format, last_boxed, parse_gold
from tests.test_cli import ROOT, _fit

HALF_GOLD = "Each part is $\\frac{1}{2}$, so the answer is $\\boxed{\\frac{1}{2}}$."
GSM8K_GOLD = "She earns 1000+234=<<1000+234=1234>>1234 dollars.\n#### 1,234"


def score(completion: object, gold: object, **settings: object) -> float:
    return MathAnswer(**settings)(["a prompt"], [completion], answer=[gold])[0]


@pytest.mark.parametrize(
    "completion",
    [
        "\\boxed{0.5}",
        "1/2",
        "The answer is \\boxed{\\dfrac12}.",
        "$\\frac{1}{2}$",
        "so it is 0.5",
        "\\boxed{\\frac{2}{4}}",
    ],
)
def test_equivalent_forms_of_one_half_score_one(completion: str) -> None:
    assert score(completion, HALF_GOLD) == 1.0
    assert score(completion, "\\frac{1}{2}", gold_format="plain") == 1.0


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("She earns \\boxed{1234} dollars.", 1.0),
        ("She earns \\boxed{1,234} dollars.", 1.0),
        ("So she earns $1,234 in total.", 1.0),
        ("1234.00", 1.0),
        ("\\boxed{1243}", 0.0),  # wrong
        ("She earns 1234 dollars, no wait: \\boxed{1230}", 0.0),  # the boxed answer counts, not the text
    ],
)
def test_gsm8k_gold_with_thousands_separator(completion: str, expected: float) -> None:
    assert score(completion, GSM8K_GOLD, gold_format="gsm8k") == expected
    assert score(completion, GSM8K_GOLD) == expected  # auto detects "####"


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        ("\\boxed{6\\sqrt{2}}", "\\boxed{\\sqrt{72}}"),
        ("$\\frac{1}{\\sqrt{2}}$", "We get $\\boxed{\\frac{\\sqrt{2}}{2}}$."),
        ("\\boxed{(-3, 3)}", "The solution set is $\\boxed{(-3,3)}$."),
        ("\\boxed{25\\pi}", "The area is $\\pi r^2 = \\boxed{25\\pi}$."),
        ("first \\boxed{7}, then checking: \\boxed{5}", "\\boxed{5}"),  # the last box is the answer
    ],
)
def test_latex_answers_against_worked_solutions(completion: str, gold: str) -> None:
    assert score(completion, gold, gold_format="boxed") == 1.0


@pytest.mark.parametrize(
    "completion",
    ["", "I do not know.", "\\boxed{}", "\\boxed{\\frac{1}", "\\boxed{x+}", None, 42, "}}}{{{\\boxed{"],
)
def test_unparsable_or_missing_completions_score_zero(completion: object) -> None:
    assert score(completion, HALF_GOLD) == 0.0


def test_wrong_answers_score_zero() -> None:
    completions = ["\\boxed{0.51}", "\\boxed{2}", "1/3", "\\boxed{-\\frac{1}{2}}"]
    assert MathAnswer()(["p"] * 4, completions, answer=[HALF_GOLD] * 4) == [0.0] * 4


def test_require_boxed_ignores_answers_outside_a_box() -> None:
    assert score("the answer is 1/2", HALF_GOLD, require_boxed=True) == 0.0
    assert score("the answer is \\boxed{1/2}", HALF_GOLD, require_boxed=True) == 1.0


def test_float_rounding_sets_the_tolerance() -> None:
    assert score("\\boxed{0.333}", "\\frac{1}{3}", gold_format="plain") == 0.0
    assert score("\\boxed{0.333}", "\\frac{1}{3}", gold_format="plain", float_rounding=2) == 1.0


def test_auto_reads_each_row_in_its_own_format() -> None:
    golds = [GSM8K_GOLD, HALF_GOLD, "42", 42]
    completions = ["\\boxed{1234}", "\\boxed{0.5}", "\\boxed{42}", "42"]
    assert MathAnswer()(["p"] * 4, completions, answer=golds) == [1.0] * 4
    assert [detect_gold_format(str(g)) for g in golds] == ["gsm8k", "boxed", "plain", "plain"]


def test_answer_column_and_missing_column() -> None:
    reward = MathAnswer(answer_column="solution")
    assert reward(["p"], ["\\boxed{5}"], solution=["So $x = \\boxed{5}$."], level=["Level 1"]) == [1.0]
    with pytest.raises(KeyError, match="'solution'.*\\['answer'\\]"):
        reward(["p"], ["5"], answer=["5"])


@pytest.mark.parametrize(
    ("gold", "gold_format", "match"),
    [
        ("The answer is 5.", "gsm8k", "#### <number>"),
        ("reasoning\n#### five", "gsm8k", "not a number"),
        ("So the answer is 5.", "boxed", "complete \\\\boxed"),
        ("unclosed \\boxed{5", "boxed", "complete \\\\boxed"),
        ("", "plain", "no answer"),
        (None, "auto", "no answer"),
    ],
)
def test_unparsable_gold_raises_naming_the_row(gold: object, gold_format: str, match: str) -> None:
    good = {"gsm8k": "#### 1", "boxed": "\\boxed{1}"}.get(gold_format, "1")
    reward = MathAnswer(gold_format=gold_format)  # type: ignore[arg-type]
    with pytest.raises(GoldAnswerError, match=match) as raised:
        reward(["fine", "the bad one"], ["1", "2"], answer=[good, gold])
    assert "row 1" in str(raised.value) and "the bad one" in str(raised.value)


def test_gold_error_shows_the_question_of_a_chat_prompt() -> None:
    chat = [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "What is 2+3?"}]
    with pytest.raises(GoldAnswerError, match="row 0 .*'What is 2\\+3\\?'"):
        MathAnswer(gold_format="gsm8k")([chat], ["5"], answer=["no marker"])


def test_called_from_a_worker_thread() -> None:
    # math-verify's default signal.alarm timeouts raise off the main thread; the trainer calls rewards there.
    reward = MathAnswer(timeout_s=5)
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["scores"] = reward(["p", "p"], ["\\boxed{\\dfrac12}", "\\boxed{3}"], answer=[HALF_GOLD] * 2)
        except BaseException as error:  # handed to the test's thread
            outcome["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["scores"] == [1.0, 0.0]


def test_picklable_for_process_isolation() -> None:
    # reward_isolation: process sends the reward to a worker, where it runs in the main thread (with alarms).
    reward = pickle.loads(pickle.dumps(MathAnswer(gold_format="boxed", require_boxed=True)))
    assert (reward.gold_format, reward.require_boxed) == ("boxed", True)
    assert reward(["p"], ["\\boxed{0.5}"], answer=[HALF_GOLD]) == [1.0]


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"gold_format": "latex"}, "gold_format must be one of \\['auto', 'gsm8k', 'boxed', 'plain'\\]"),
        ({"answer_column": ""}, "answer_column"),
        ({"require_boxed": "yes"}, "require_boxed"),
        ({"float_rounding": -1}, "float_rounding must be an integer from 0 to 15"),
        ({"float_rounding": 2.5}, "float_rounding"),
        ({"timeout_s": 0}, "timeout_s must be a whole number of seconds >= 1, or None"),
        ({"timeout_s": 0.5}, "timeout_s"),
    ],
)
def test_bad_settings_raise(settings: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MathAnswer(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("a \\boxed{1} b \\boxed{2}", "2"),
        ("\\fbox{3}", "3"),
        ("so \\boxed 5.", "5"),
        ("\\boxed{1", None),
        ("no box", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


def test_parsed_golds_are_cached() -> None:
    parse_gold.cache_clear()
    reward = MathAnswer()
    reward(["p"] * 8, ["\\boxed{1}"] * 8, answer=[HALF_GOLD] * 8)  # one group: one reference, G responses
    assert parse_gold.cache_info().misses == 1


@pytest.mark.slow
def test_math_sample_config_runs_end_to_end(tmp_path: Path) -> None:
    # A copy in tmp_path: _fit runs the CLI there, so logs and checkpoints land in tmp_path.
    config = tmp_path / "math_sample.yaml"
    shutil.copy(ROOT / "configs/math_sample.yaml", config)
    result = _fit(config, "--trainer.max_steps=2", "--evaluation.every_n_steps=0")
    assert "optimizer steps: 2" in result.stdout
    rows = list(csv.DictReader((tmp_path / "runs/math_sample/version_0/metrics.csv").open()))
    columns = set(rows[0])
    assert {"rollout/reward/MathAnswer", "rollout/reward/FormatReward", "eval/accuracy"} <= columns
    rewards = [float(r["rollout/reward/MathAnswer"]) for r in rows if r["rollout/reward/MathAnswer"]]
    assert rewards and all(0.0 <= value <= 1.0 for value in rewards)
