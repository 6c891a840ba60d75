"""What the command line shows: library notices silenced, project warnings plain, progress counting optimizer steps
(rich's bar on a terminal, plain lines elsewhere, resumed runs included), Ctrl-C stopping at a step's end, and the
run summary."""

from __future__ import annotations

import io
import logging
import os
import signal
import warnings
from pathlib import Path

import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import SIGTERMException

from gspo_lightning.asynchronous import AsyncRollouts
from gspo_lightning.callbacks import CheckpointOnPreemption
from gspo_lightning.console import plain_project_warnings, quiet_library_noise
from gspo_lightning.interrupt import StopOnInterrupt
from gspo_lightning.progress import PlainProgress, Progress, StepProgressBar, duration, progress_bar, progress_line
from gspo_lightning.summary import RunOutcome, resume_command, rollout_mode, summary_text


def test_library_notices_are_silenced_and_real_warnings_are_not(caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_library_noise()
        warnings.warn("'set_vital' is deprecated, please do not call", UserWarning)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
        warnings.warn("sampler.top_p is ignored here", UserWarning)  # a real one stays
    assert [str(w.message) for w in caught] == ["sampler.top_p is ignored here"]
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("💡 Tip: For seamless cloud logging ...")
        logger.info("GPU available: False, used: False")
    assert [record.getMessage() for record in caplog.records] == ["GPU available: False, used: False"]


class _ReadDescription(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[str, bool, float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar = trainer.progress_bar_callback
        task = next(t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id)
        self.seen.append((task.description, "v_num" in bar.get_metrics(trainer, pl_module), task.completed, task.total))


def test_the_rich_bar_counts_optimizer_steps_not_epochs(tmp_path):
    pytest.importorskip("rich")
    reader = _ReadDescription()
    trainer = Trainer(default_root_dir=tmp_path, max_steps=3, max_epochs=-1, callbacks=[StepProgressBar(), reader],
                      enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(BoringModel())
    assert reader.seen == [("optimizer steps", False, step, 3) for step in (1, 2, 3)]  # not "Epoch 0/-2", no v_num


def test_a_resumed_runs_bar_counts_global_steps_out_of_max_steps(tmp_path):
    pytest.importorskip("rich")
    first = Trainer(default_root_dir=tmp_path, max_steps=3, max_epochs=-1, enable_model_summary=False,
                    callbacks=[StepProgressBar()])  # fmt: skip
    first.fit(BoringModel())
    first.save_checkpoint(tmp_path / "at3.ckpt")
    reader = _ReadDescription()
    resumed = Trainer(default_root_dir=tmp_path, max_steps=5, max_epochs=-1, enable_model_summary=False,
                      callbacks=[StepProgressBar(), reader])  # fmt: skip
    resumed.fit(BoringModel(), ckpt_path=tmp_path / "at3.ckpt")
    # Lightning's own count: "Epoch 0/-2", 1/2 and 2/2 (the batches left); the run is at steps 4 and 5 of 5
    assert reader.seen == [("optimizer steps", False, 4, 5), ("optimizer steps", False, 5, 5)]


def test_a_progress_line_says_where_the_run_is_how_fast_and_how_stale():
    progress = Progress(step=250, max_steps=2000, steps_done=200, seconds=100.0, reward=0.4123,
                        accuracy=(250, 0.3828125), lag=0.96875, lag_max=1.0)  # fmt: skip
    # 2 steps/s over this process's 200 steps: 1750 steps left take 875 s
    assert progress_line(progress) == (
        "step 250/2000  reward 0.412  held-out 38.3% (step 250)  lag 0.97 (max 1)  2.00 steps/s  1m40s, 14m35s left"
    )
    assert progress_line(Progress(step=1, max_steps=-1, steps_done=0, seconds=0.4)) == "step 1  0s"
    assert [duration(s) for s in (0, 59.4, 61, 3599, 7620)] == ["0s", "59s", "1m01s", "59m59s", "2h07m"]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_is_rich_on_a_terminal_and_plain_lines_elsewhere():
    pytest.importorskip("rich")
    assert isinstance(progress_bar(None, _Tty()), StepProgressBar)
    assert isinstance(progress_bar(None, io.StringIO()), PlainProgress)


def test_plain_progress_prints_after_the_first_step_every_n_steps_and_at_the_last(tmp_path, capsys):
    bar = PlainProgress(every_seconds=3600, every_n_steps=3)
    trainer = Trainer(default_root_dir=tmp_path, max_steps=7, max_epochs=-1, callbacks=[bar],
                      enable_checkpointing=False, enable_model_summary=False, logger=False)  # fmt: skip
    trainer.fit(BoringModel())
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/7", "3/7", "6/7", "7/7"]
    assert lines[-1].endswith(", 0s left") and " steps/s  " in lines[-1]
    with pytest.raises(ValueError, match="every_seconds > 0"):
        PlainProgress(every_seconds=0)


def test_project_warnings_print_without_their_source_file():
    plain_project_warnings()
    ours = str(Path(__import__("gspo_lightning").__file__).parent / "rollout" / "checks.py")
    assert warnings.formatwarning("the bound is 2", UserWarning, ours, 324) == "warning: the bound is 2\n"
    theirs = warnings.formatwarning("deprecated", FutureWarning, "/elsewhere/lib.py", 7)
    assert theirs.startswith("/elsewhere/lib.py:7: FutureWarning: deprecated")


class _CtrlCAtStep(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_finishes_the_step_in_flight_saves_a_checkpoint_and_stops(tmp_path, capsys):
    stopper, preemption = StopOnInterrupt(), CheckpointOnPreemption()
    handler = signal.getsignal(signal.SIGINT)
    trainer = Trainer(default_root_dir=tmp_path, max_steps=10, max_epochs=-1, enable_progress_bar=False,
                      callbacks=[stopper, preemption, _CtrlCAtStep()], enable_model_summary=False)  # fmt: skip
    with pytest.raises(SIGTERMException):
        trainer.fit(BoringModel())
    assert stopper.interrupted and trainer.global_step == 3  # step 2 (the third) finished, nothing after it
    assert preemption.saved_to and Path(preemption.saved_to).exists()
    assert "Ctrl-C: stopping after the optimizer step in flight" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C means what it meant before, again


def test_the_resume_command_is_the_command_run_with_ckpt_path_last():
    argv = ["fit", "-c", "my config.yaml", "--ckpt_path", "old.ckpt", "--trainer.max_steps=9", "--ckpt_path=x"]
    assert resume_command("python -m gspo_lightning", argv) == (
        "python -m gspo_lightning fit -c 'my config.yaml' --trainer.max_steps=9 --ckpt_path last"
    )


def test_the_summary_of_a_stopped_asynchronous_run_says_where_it_stopped_how_stale_and_how_to_resume():
    progress = Progress(step=137, max_steps=2000, steps_done=37, seconds=50.0, lag=1.0, lag_max=1.0)
    outcome = RunOutcome(
        progress, seconds=64.2, log_dir="runs/q/version_0", checkpoint="runs/q/version_0/checkpoints/last.ckpt",
        history=[(0, 0.25), (100, 0.3125)], asynchronous=AsyncRollouts(mode="fixed_lag", lag=1),
        stopped_by="Ctrl-C", resume="python -m gspo_lightning fit -c q.yaml --ckpt_path last",
    )  # fmt: skip
    assert summary_text(outcome).splitlines() == [
        "",
        "=== gspo_lightning run summary: stopped by Ctrl-C at step 137 ===",
        "held-out accuracy: 25.0% (step 0) -> 31.2% (step 100), +6.2 points",
        "optimizer steps: 137 of 2000   time: 1m04s",
        "rollouts: asynchronous, fixed lag 1 (sampler.asynchronous.lag); trained tokens at most 1 version old",
        "logs: runs/q/version_0",
        "last checkpoint: runs/q/version_0/checkpoints/last.ckpt",
        "resume with: python -m gspo_lightning fit -c q.yaml --ckpt_path last",
    ]
    finished = RunOutcome(Progress(step=10, max_steps=10, steps_done=10, seconds=5.0), seconds=6.0)
    assert summary_text(finished).splitlines()[1:] == [
        "=== gspo_lightning run summary ===",
        "optimizer steps: 10   time: 6s",
    ]
    streaming = AsyncRollouts(mode="streaming", max_staleness=2, chunk_tokens=16)
    assert rollout_mode(streaming) == (
        "asynchronous, streaming in chunks of 16 tokens, max_staleness 2 (sampler.asynchronous.max_staleness)"
    )
    assert rollout_mode(AsyncRollouts()).startswith("on-policy")
    unsaved = RunOutcome(Progress(step=3, max_steps=10, steps_done=3, seconds=1.0), seconds=2.0, stopped_by="Ctrl-C")
    assert summary_text(unsaved).splitlines()[-1] == "no checkpoint was saved: the same command starts the run again"
