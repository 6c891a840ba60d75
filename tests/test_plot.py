"""``python -m gspo_lightning plot``: reads what the CSV logger wrote and draws every panel."""

from __future__ import annotations

import csv
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_lightning.plot import (
    build_figure,
    default_window,
    main,
    metrics_file,
    panel_series,
    read_metrics,
    run_label,
    smooth,
)

ROOT = Path(__file__).resolve().parents[1]


def write_run(directory: Path, steps: int, scale: float = 1.0) -> Path:
    """A metrics.csv as the CSV logger writes it: one row per logging call, empty cells for what it lacks."""
    names = ["epoch", "step", "rollout/reward_mean", "train/clip_frac", "train/entropy", "eval/accuracy",
             "diag/seq_ratio_p05", "diag/seq_ratio_p50", "diag/seq_ratio_p95",
             "drift/kl_old_theta_mb0", "drift/kl_old_theta_mb1", "lr-AdamW"]  # fmt: skip
    directory.mkdir(parents=True)
    with (directory / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names)
        writer.writeheader()
        for step in range(steps):
            writer.writerow({"epoch": 0, "step": step, "lr-AdamW": 1e-4})
            index = step % 2
            writer.writerow({
                "epoch": 0, "step": step, "rollout/reward_mean": scale * step / steps, "train/clip_frac": 0.1,
                "train/entropy": 1 - step / steps, "diag/seq_ratio_p05": 0.99, "diag/seq_ratio_p50": 1.0,
                "diag/seq_ratio_p95": 1.01, f"drift/kl_old_theta_mb{index}": 1e-3 * index,
                f"drift/kl_old_theta_mb{1 - index}": "nan",
            })  # fmt: skip
            if step % 10 == 0:
                writer.writerow({"epoch": 0, "step": step, "eval/accuracy": 0.2 + step / 1000})
    return directory


def write_noisy_run(directory: Path, steps: int = 2000, seed: int = 0, evals: int = 9, minibatches: int = 4) -> Path:
    """A run as a real one looks: noisy per-step metrics, a warm-up then cosine learning rate, drift logged at its
    minibatch's steps only (mb0 exactly 0), ``evals`` held-out evaluations (accuracy and pass@4)."""
    rng = random.Random(seed)
    drift = [f"drift/kl_old_theta_mb{k}" for k in range(minibatches)]
    names = ["epoch", "step", "rollout/reward_mean", "train/loss", "train/clip_frac", "train/entropy",
             "diag/seq_ratio_p05", "diag/seq_ratio_p50", "diag/seq_ratio_p95", "rollout/response_len_mean",
             "rollout/response_len_max", "rollout/zero_variance_frac", "lr-AdamW", "eval/accuracy", "eval/pass@4",
             *drift]  # fmt: skip
    directory.mkdir(parents=True)
    with (directory / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names)
        writer.writeheader()
        for step in range(steps):
            progress, k = step / steps, step % minibatches
            lr = 1e-4 * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * (1 + math.cos(math.pi * progress)) / 2)
            writer.writerow({"epoch": 0, "step": step, "lr-AdamW": lr})
            spread = rng.uniform(0.02, 0.05) * (k > 0)
            writer.writerow({
                "epoch": 0, "step": step, "rollout/reward_mean": 0.3 + 0.3 * progress + rng.gauss(0, 0.05),
                "train/loss": rng.gauss(0, 0.01), "train/clip_frac": max(0.0, 0.25 + rng.gauss(0, 0.06)) * (k > 0),
                "train/entropy": 0.45 - 0.2 * progress + rng.gauss(0, 0.02), "diag/seq_ratio_p05": 1 - spread,
                "diag/seq_ratio_p50": 1 + rng.gauss(0, 0.003) * (k > 0), "diag/seq_ratio_p95": 1 + spread,
                "rollout/response_len_mean": 5 + 2 * progress + rng.gauss(0, 0.3),
                "rollout/response_len_max": 9 + rng.randint(0, 4), "rollout/zero_variance_frac": rng.uniform(0.1, 0.2),
                **{name: "nan" for name in drift}, drift[k]: k * 1e-3 * rng.lognormvariate(0, 0.8),
            })  # fmt: skip
        for step in [round(i * steps / (evals - 1)) for i in range(evals)]:
            accuracy = 0.23 + 0.15 * step / steps + rng.gauss(0, 0.01)
            writer.writerow({"epoch": 0, "step": step, "eval/accuracy": accuracy, "eval/pass@4": accuracy + 0.2})
    return directory


def panels_of(figure) -> dict[str, object]:
    """The figure's panels by the first line of their title."""
    return {axis.get_title().split("\n")[0]: axis for axis in figure.axes}


def drawn_lines(axis) -> list:
    """The data lines of a panel (not legend proxies), with their labels."""
    return [line for line in axis.get_lines() if len(line.get_xdata())]


def test_metrics_are_read_per_step_without_the_empty_and_nan_cells(tmp_path):
    series = read_metrics(write_run(tmp_path / "run", steps=20))
    steps, rewards = series["rollout/reward_mean"]
    assert steps == list(range(20)) and rewards == pytest.approx([s / 20 for s in range(20)])
    assert series["eval/accuracy"][0] == [0, 10]
    assert series["drift/kl_old_theta_mb1"][0] == list(range(1, 20, 2))  # NaN at the other index's steps
    drift = panel_series(series, ("drift/kl_old_theta_mb*",))
    assert list(drift) == ["drift/kl_old_theta_mb0", "drift/kl_old_theta_mb1"]


def test_smoothing_is_a_trailing_mean_over_steps():
    assert smooth([0, 1, 2, 3], [1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([0, 1], [1.0, 3.0], 1) == [1.0, 3.0]
    # an evaluation every 100 steps is not averaged with the earlier ones by a 10-step window
    assert smooth([0, 100, 200], [0.2, 0.3, 0.4], 10) == [0.2, 0.3, 0.4]
    assert smooth([0, 1, 5, 6], [1.0, 3.0, 5.0, 7.0], 3) == [1.0, 2.0, 5.0, 6.0]


def test_the_newest_version_of_a_run_is_read(tmp_path):
    write_run(tmp_path / "quickstart/version_2", steps=3)
    write_run(tmp_path / "quickstart/version_10", steps=5)
    assert metrics_file(tmp_path / "quickstart") == tmp_path / "quickstart/version_10/metrics.csv"
    assert run_label(tmp_path / "quickstart/version_10") == "quickstart/version_10"


def test_two_runs_overlay_into_one_png_from_the_command_line(tmp_path):
    pytest.importorskip("matplotlib")
    first, second = write_run(tmp_path / "a", steps=40), write_run(tmp_path / "b", steps=30, scale=0.5)
    output = tmp_path / "both.png"
    command = [sys.executable, "-m", "gspo_lightning", "plot", str(first), str(second), "-o", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and output.stat().st_size > 20_000


def test_a_directory_without_metrics_is_named_in_the_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere")])
    assert "nowhere: no metrics.csv" in capsys.readouterr().err


NEW_PANELS = ("loss", "learning rate", "response length", "groups without signal")


@pytest.fixture(scope="module")
def noisy_run(tmp_path_factory):
    """A 2000-step run read back: noise, 9 held-out evaluations, 4 minibatches."""
    return read_metrics(write_noisy_run(tmp_path_factory.mktemp("noisy") / "run"))


def test_every_panel_names_its_metric_its_unit_and_the_optimizer_step(noisy_run):
    pytest.importorskip("matplotlib")
    panels = panels_of(build_figure({"run": noisy_run}))
    assert list(panels) == ["reward", "held-out accuracy", "loss", "clip fraction", "sequence ratio quantiles",
                            "drift per minibatch", "entropy", "response length", "groups without signal",
                            "learning rate"]  # fmt: skip
    for title, axis in panels.items():
        assert axis.get_ylabel().strip(), f"{title}: no y label"
        assert axis.get_xlabel() == "optimizer step"
        assert "/" in axis.get_title() or "lr-AdamW" in axis.get_title(), f"{title}: the metric is not named"
    assert "eval/{accuracy, pass@4}" in panels["held-out accuracy"].get_title()
    assert "nats/token" in panels["entropy"].get_ylabel() and "tokens" in panels["response length"].get_ylabel()


def test_noisy_series_are_drawn_per_step_under_their_trailing_mean(noisy_run):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_rgba

    steps, rewards = noisy_run["rollout/reward_mean"]
    raw, bold = drawn_lines(panels_of(build_figure({"run": noisy_run}, window=40))["reward"])
    assert list(raw.get_ydata()) == rewards and list(bold.get_ydata()) == pytest.approx(smooth(steps, rewards, 40))
    assert to_rgba(raw.get_color()) == to_rgba(bold.get_color())
    assert raw.get_linewidth() < bold.get_linewidth() and raw.get_alpha() < 0.5 and bold.get_alpha() in (None, 1)
    (only,) = drawn_lines(panels_of(build_figure({"run": noisy_run}, window=1))["reward"])
    assert list(only.get_ydata()) == rewards  # --smooth 1: per step only


def test_held_out_evaluations_are_markers_as_logged_with_their_first_and_last_value(noisy_run):
    pytest.importorskip("matplotlib")
    axis = panels_of(build_figure({"run": noisy_run}, window=400))["held-out accuracy"]
    lines = {line.get_label(): line for line in drawn_lines(axis)}
    assert set(lines) == {"accuracy", "pass@4"}
    for name, line in lines.items():
        steps, values = noisy_run[f"eval/{name}"]
        assert len(steps) == 9 and list(line.get_xdata()) == steps
        assert list(line.get_ydata()) == values, f"{name} was smoothed"
        assert line.get_marker() not in (None, "None", "", " "), f"{name} is a plain line, without markers"
        assert line.get_linewidth() <= 1.0
    written = {text.get_text() for text in axis.texts}
    accuracy = noisy_run["eval/accuracy"][1]
    assert {f"{accuracy[0]:.1%}", f"{accuracy[-1]:.1%}"} <= written


def test_each_minibatch_has_its_own_colour_a_legend_and_a_log_axis(noisy_run):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_rgba

    axis = panels_of(build_figure({"run": noisy_run}))["drift per minibatch"]
    labelled = [line for line in drawn_lines(axis) if not line.get_label().startswith("_")]
    assert [line.get_label() for line in labelled] == ["mb0", "mb1", "mb2", "mb3"]
    assert len({to_rgba(line.get_color()) for line in labelled}) == 4, "minibatches share a colour"
    assert [text.get_text() for text in axis.get_legend().get_texts()] == ["mb0", "mb1", "mb2", "mb3"]
    assert axis.get_yscale() == "symlog"  # spans decades, and minibatch 0's drift is exactly 0


def test_the_new_panels_are_drawn_when_logged_and_missing_ones_are_left_out(tmp_path, noisy_run):
    pytest.importorskip("matplotlib")
    full = build_figure({"run": noisy_run})
    panels = panels_of(full)
    assert set(NEW_PANELS) <= set(panels)
    assert panels["learning rate"].get_yscale() == "log"  # warm-up from 1e-6 to 1e-4
    assert {line.get_label() for line in drawn_lines(panels["response length"])} >= {"mean", "max"}
    sparse = build_figure({"run": read_metrics(write_run(tmp_path / "sparse", steps=40))})
    missing = set(NEW_PANELS) - {"learning rate"}  # write_run logs lr-AdamW, not the loss, lengths or groups
    assert not missing & set(panels_of(sparse)) and "learning rate" in panels_of(sparse)
    assert len(sparse.axes) == 7 and not any(text.get_text() == "not logged" for a in sparse.axes for text in a.texts)
    assert sparse.get_figheight() < full.get_figheight()  # sized to the panels drawn
    moe = dict(noisy_run, **{f"moe/expert_change_mb{k}": ([0, 4], [0.01 * k, 0.02 * k]) for k in range(4)})
    assert "MoE expert changes per minibatch" in panels_of(build_figure({"run": moe}))


def test_several_runs_have_one_colour_each_across_panels_and_one_legend(tmp_path, noisy_run):
    pytest.importorskip("matplotlib")
    from matplotlib.colors import to_rgba

    other = read_metrics(write_noisy_run(tmp_path / "other", steps=300, seed=1))
    figure = build_figure({"gspo": noisy_run, "grpo": other})
    panels = panels_of(figure)
    for title in ("reward", "entropy", "held-out accuracy"):
        labelled = [line for line in drawn_lines(panels[title]) if not line.get_label().startswith("_")]
        colours = [to_rgba(line.get_color()) for line in labelled]
        assert colours[0] != colours[-1] and colours[0] == to_rgba(drawn_lines(panels["reward"])[0].get_color())
    (legend,) = figure.legends
    assert [text.get_text() for text in legend.get_texts()] == ["gspo", "grpo"]
    drift = [line for line in drawn_lines(panels["drift per minibatch"]) if not line.get_label().startswith("_")]
    assert len({(to_rgba(line.get_color()), line.get_linestyle()) for line in drift}) == 8  # 2 runs x 4 minibatches
    assert all(axis.get_legend() is None or "gspo" not in axis.get_legend().get_texts()[0].get_text()
               for axis in figure.axes)  # fmt: skip


def test_the_default_window_follows_the_run_length(noisy_run, tmp_path):
    assert default_window({"run": noisy_run}) == 40
    assert default_window({"run": read_metrics(write_run(tmp_path / "short", steps=40))}) == 10
