"""The experiments' shared helpers: per-step metrics, the training clock, seed bands; every script parses."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from common import band, per_step, smooth, training_clock  # noqa: E402


def test_per_step_merges_the_rows_the_csv_logger_writes_for_one_step(tmp_path):
    metrics = tmp_path / "metrics.csv"
    metrics.write_text(
        "step,train/loss,time/generate_s,time/train_s,eval/accuracy\n"
        "0,,,,0.25\n0,0.5,1.0,0.5,\n1,0.25,,0.25,\n"
    )
    steps = per_step(metrics)
    assert steps == {0: {"train/loss": 0.5, "time/generate_s": 1.0, "time/train_s": 0.5, "eval/accuracy": 0.25},
                     1: {"train/loss": 0.25, "time/train_s": 0.25}}  # fmt: skip
    assert training_clock(steps) == {0: 1.5, 1: 1.75}


def test_band_and_smooth():
    xs, mean, low, high = band([([0, 10], [1.0, 3.0]), ([0, 12, 20], [3.0, 5.0, 9.0])])
    assert (xs, mean, low, high) == ([0, 11], [2.0, 4.0], [1.0, 3.0], [3.0, 5.0])
    assert smooth([1.0, math.nan, 3.0], window=2) == [1.0, 1.0, 3.0]


@pytest.mark.parametrize("script", sorted(ROOT.glob("experiments/*/run.py")), ids=lambda p: p.parent.name)
def test_every_experiment_script_documents_its_command(script):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"python experiments/{script.parent.name}/run.py" in result.stdout


def _script(name: str):
    from common import load_script

    return load_script(ROOT / f"experiments/{name}/run.py")


def test_length_correction_weights_by_hand():
    """Two responses, per-token log(pi_old / pi_behav) of 4 tokens each; figures of their first 2 and 4 tokens."""
    torch = pytest.importorskip("torch")
    length = _script("length_correction")
    d = torch.tensor([[0.5, 0.5, 1.0, 1.0], [-0.5, -0.5, -1.0, -1.0]], dtype=torch.float64)
    two = length.correction_weights(d, 2, cap=2.0)
    # product: log w = +1, -1 -> w = e, 1/e; TIS: min(e, 2) = 2 -> mean (2 + 1/e) / 2; MIS keeps neither
    assert two["product_log_mean"] == pytest.approx(0.0) and two["product_log_std"] == pytest.approx(math.sqrt(2))
    assert two["product_effective_lr"] == pytest.approx((2 + math.exp(-1)) / 2, rel=1e-12)
    assert two["product_mis_kept"] == 0.0
    assert two["product_ess"] == pytest.approx((math.e + 1 / math.e) ** 2 / (2 * (math.e**2 + math.e**-2)), rel=1e-12)
    # length-normalised: log w = +0.5, -0.5, both within [1/2, 2]
    assert two["normalised_effective_lr"] == pytest.approx((math.exp(0.5) + math.exp(-0.5)) / 2, rel=1e-12)
    assert two["normalised_mis_kept"] == 1.0
    assert two["normalised_outside_gspo_clip"] == 1.0  # both far outside GSPO's [1 - 3e-4, 1 + 4e-4]
    near = length.correction_weights(torch.tensor([[3.5e-4, 3.5e-4], [-3.5e-4, -3.5e-4]], dtype=torch.float64), 2)
    assert near["normalised_outside_gspo_clip"] == 0.5  # e^3.5e-4 inside the upper bound, e^-3.5e-4 below 1 - 3e-4
    four = length.correction_weights(d, 4, cap=2.0)  # log w = +3, -3 product; +0.75, -0.75 normalised
    assert four["product_effective_lr"] == pytest.approx((2 + math.exp(-3)) / 2, rel=1e-12)
    assert four["normalised_median"] == pytest.approx(math.exp(-0.75))  # torch's median of two: the lower
    assert four["normalised_mis_kept"] == 0.0  # e^0.75 = 2.12 > 2


def test_lognormal_effective_lr_against_sampling():
    torch = pytest.importorskip("torch")
    length = _script("length_correction")
    assert length.lognormal_effective_lr(0.0, 0.0) == 1.0 and length.lognormal_effective_lr(2.0, 0.0) == 2.0
    generator = torch.Generator().manual_seed(0)
    for mean, std in ((-0.5, 1.0), (-2.0, 2.0), (0.1, 0.3)):
        samples = (mean + std * torch.randn(400_000, generator=generator, dtype=torch.float64)).exp().clamp(max=2.0)
        assert length.lognormal_effective_lr(mean, std) == pytest.approx(samples.mean().item(), abs=5e-3)


def test_length_correction_old_logprobs_mirror_the_engines_eos_suppression():
    """With EOS suppressed the engine samples from pi renormalised without EOS: pi_old must be the same
    distribution, log pi(y) - log(1 - pi(EOS)) at every token; without the mask it is the plain log pi(y)."""
    torch = pytest.importorskip("torch")
    length = _script("length_correction")
    args = type("Args", (), dict(seed=0, vocab=64, width=64, layers=1, max_length=6, responses=3))()
    policy = length.build_policy(args, 1.0)
    ids = torch.randint(1, args.vocab, (3, length.PROMPT_TOKENS + 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = torch.log_softmax(policy(ids).logits[:, -7:-1].double(), -1)  # [3, 6, V]
    plain = full.gather(-1, ids[:, -6:, None]).squeeze(-1)  # [3, 6]
    renormalised = plain - torch.log1p(-full[..., length.EOS].exp())  # [3, 6]
    assert length.old_logprobs(policy, ids, 6, mask_eos=False).double() == pytest.approx(plain, abs=1e-5)
    masked = length.old_logprobs(policy, ids, 6, mask_eos=True).double()
    assert masked == pytest.approx(renormalised, abs=1e-5)
    assert (masked - plain).min() > 1e-3  # the correction is not lost in the tolerance

def test_episode_shape_and_spread_by_hand():
    torch = pytest.importorskip("torch")
    episodes = _script("episodes")
    # row 0: two turns (2 + 1 policy tokens) around 2 tool tokens, 3 prompt tokens; row 1: one turn of 1 token
    response_mask = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 0, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 1, 0, 0, 0]])
    turns, policy, context = episodes.episode_shape(response_mask, attention)
    assert turns.tolist() == [2, 1] and policy.tolist() == [3, 1] and context.tolist() == [5, 2]
    new = torch.tensor([[0.1, 0.4, 9.0, 9.0, 0.7], [0.0, 0.3, 9.0, 9.0, 9.0]])
    old = torch.zeros(2, 5)
    mean, spread = episodes.log_ratio_spread(new, old, response_mask)
    assert mean.tolist() == pytest.approx([0.4, 0.3])
    assert spread.tolist() == pytest.approx([math.sqrt((0.09 + 0 + 0.09) / 2), 0.0])


def test_call_bonus_pays_once_for_a_call_that_ran():
    episodes = _script("episodes")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*3"}}</tool_call>'
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*x"}}</tool_call>'
    environment = episodes.CalculatorCallBonus(bonus=0.2)
    assert environment.step(bad).reward == 0.0  # the tool answered with an error
    first = environment.step(call)
    assert first.reward == 0.2 and first.observation[0]["content"] == "36"
    assert environment.step(call).reward == 0.0  # once per episode
    assert environment.step("The answer is 36.").done


def test_quickstart_landing_searches_the_warm_start_stop_by_hand():
    landing = _script("quickstart_landing")
    probe = landing.Probe
    assert landing.next_stop([], 0.30) == landing.FIRST_STOP  # no probe yet
    assert landing.next_stop([probe(0, 440, 0.32)], 0.30) is None  # 2 points off: within the tolerance (2.5)
    # one side only: a step per point still to go (2.8 points: 3 steps earlier; 20: 20 later), at most 40
    assert landing.next_stop([probe(0, 440, 0.328)], 0.30) == 437
    assert landing.next_stop([probe(0, 440, 0.20)], 0.40) == 460
    assert landing.next_stop([probe(0, 400, 0.05)], 0.50) == 440
    assert landing.next_stop([probe(0, 420, 0.05), probe(0, 400, 0.01)], 0.15) == 430  # from the nearest stop
    assert landing.next_stop([probe(0, 20, 0.90)], 0.30) is None  # it cannot stop before step 1
    # both sides: bisect the bracketing stops, whichever probe is nearer
    bracket = [probe(0, 420, 0.18), probe(0, 440, 0.50), probe(0, 460, 0.60)]
    assert landing.next_stop(bracket, 0.35) == 430
    assert landing.next_stop([probe(0, 430, 0.20), probe(0, 431, 0.50)], 0.35) is None  # no step between
    assert landing.closest(bracket, 0.52) == probe(0, 440, 0.50)
    tie = [probe(0, 460, 0.75), probe(0, 440, 0.50)]
    assert landing.closest(tie, 0.625) == probe(0, 440, 0.50)  # 12.5 points either side: the earlier stop
    assert landing.closest([], 0.3) is None


def test_quickstart_landing_judges_only_starts_within_25_to_45_percent():
    landing = _script("quickstart_landing")
    rows = [
        {"run": "low", "accuracy_step0": 0.20, "accuracy_end": 0.30, "gain_points": 10.0},  # outside: not judged
        {"run": "edge", "accuracy_step0": 0.25, "accuracy_end": 0.55, "gain_points": 30.0},  # exactly +30: passes
        {"run": "slow", "accuracy_step0": 0.45, "accuracy_end": 0.70, "gain_points": 25.0},  # judged, fails
        {"run": "high", "accuracy_step0": 0.46, "accuracy_end": 0.50, "gain_points": 4.0},  # outside
    ]
    assert [row["run"] for row in landing.failures(rows)] == ["slow"]
    assert landing.verdict(rows) == (
        "2 of 4 runs started within 25%-45% (25.0%-45.0%); they ended at 55.0%-70.0%, gaining +25.0 to +30.0 "
        "points; below +30: slow"
    )
    assert landing.verdict(rows[:2]).endswith(": every one gained at least +30")
    assert landing.verdict(rows[:1]) == "no run started within 25%-45%: nothing judged"
    plans = landing.plans([0, 1], [0.25], [2])
    assert [(p.name, p.landing, p.one_core) for p in plans] == [
        ("forced 25%, seed 0", 0.25, False), ("forced 25%, seed 1", 0.25, False),
        ("as configured, seed 0", None, False), ("as configured, seed 1", None, False),
        ("one core, seed 2", None, True),
    ]  # fmt: skip
