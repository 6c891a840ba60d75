"""Nothing named ``gspo-sandbox-*`` outlives the sandbox's use: not after a run, not after a trainer (or a reward
worker) that was killed, not after a forked helper exited; and removing what a dead trainer left never follows a
link out of it.

Each trainer here is a child process with ``TMPDIR`` pointed at a folder of the test's own, so only the folders
it made are counted (other sandboxes may be running on this machine). ``RewardRunner.close()`` kills its reward
worker with SIGKILL, which skips every exit handler: the children below die the same way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gspo_lightning.sandbox import hostdir
from tests.sandbox.conftest import ROOT, Victims, needs_isolation
from tests.sandbox.hostile import CLEANUP

pytestmark = needs_isolation

# The suite's 1,500 nested folders, with links out of the tree at its top and bottom (what a program leaves).
DEEP = next(hostile for hostile in CLEANUP if hostile.name == "deep_directories").source
LINKS = "for name, target in (('ckpt_dir', 'CKPT'), ('ckpt_file', 'CKPT/last.ckpt'), ('up', 'VICTIMS')):\n"
LINKS += "    os.symlink(target, name)\n"
DEEP_WITH_LINKS = "import os\n" + LINKS + DEEP + LINKS + "print('made')\n"

# A trainer: the sandbox package alone (no torch), one run per program given, then the way it ends.
TRAINER = r"""
import json, os, signal, sys, time, types
package = types.ModuleType("gspo_lightning")
package.__path__ = [os.path.join(sys.argv[1], "gspo_lightning")]
sys.modules["gspo_lightning"] = package
from gspo_lightning.sandbox import Sandbox, SandboxLimits
box = Sandbox(SandboxLimits(wall_time_s=10))
box.check()
print("probed", flush=True)
if sys.argv[3] == "fork":  # a helper forked after the sandbox was set up, ending normally (exit handlers run)
    child = os.fork()
    if child == 0:
        sys.exit(0)
    os.waitpid(child, 0)
for program in json.loads(sys.argv[2]):
    result = box.run({"main.py": program}, "main.py")
    print(json.dumps([result.exit_code, result.isolated, result.error, result.stdout]), flush=True)
if sys.argv[3] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def start_trainer(tmpdir: Path, programs: list[str], ending: str) -> subprocess.Popen:
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmpdir)}
    command = [sys.executable, "-c", TRAINER, str(ROOT), json.dumps(programs), ending]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(trainer: subprocess.Popen) -> list[list]:
    stdout, stderr = trainer.communicate(timeout=120)
    lines = stdout.splitlines()
    assert lines[:1] == ["probed"], stderr[-2000:]
    return [json.loads(line) for line in lines[1:]]


def left_in(tmpdir: Path) -> list[str]:
    return sorted(path.name for path in tmpdir.iterdir())


@pytest.fixture
def tmpdir_of_trainers(tmp_path: Path) -> Path:
    folder = tmp_path / "tmp"
    folder.mkdir()
    return folder


def fill(source: str, victims: Victims) -> str:
    return source.replace("CKPT", str(victims.checkpoints)).replace("VICTIMS", str(victims.root))


def test_a_trainer_killed_after_its_runs_leaves_no_folder(tmpdir_of_trainers, victims):
    """The issue: the 1,500-folder program's trainer (a reward worker closed by SIGKILL) left its root folder."""
    trainer = start_trainer(tmpdir_of_trainers, [fill(DEEP_WITH_LINKS, victims)] * 2, "killed")
    results = finish(trainer)
    assert trainer.returncode == -signal.SIGKILL
    assert results == [[0, True, None, "made\n"]] * 2
    assert left_in(tmpdir_of_trainers) == []
    assert victims.changes() == {}


def test_a_trainer_that_exits_normally_leaves_no_folder(tmpdir_of_trainers, victims):
    trainer = start_trainer(tmpdir_of_trainers, [fill(DEEP_WITH_LINKS, victims)], "normally")
    assert finish(trainer) == [[0, True, None, "made\n"]] and trainer.returncode == 0
    assert left_in(tmpdir_of_trainers) == []
    assert victims.changes() == {}


def test_a_forked_helper_exiting_does_not_take_the_trainers_folder(tmpdir_of_trainers):
    """A child forked from the trainer inherits its exit handlers: they must not remove a folder still in use."""
    trainer = start_trainer(tmpdir_of_trainers, ["print('ok')"], "fork")
    assert finish(trainer) == [[0, True, None, "ok\n"]]
    assert left_in(tmpdir_of_trainers) == []


def _plant_abandoned_tree(tmpdir: Path, victims: Victims) -> Path:
    """What a trainer killed during a fallback run leaves: its folder, 1,500 deep, with links to the victims."""
    planted = tmpdir / "gspo-sandbox-run-planted"
    (planted / "work").mkdir(parents=True)
    folder = os.open(planted / "work", os.O_RDONLY)
    for depth in range(1500):  # by descriptor: the path would pass PATH_MAX
        if depth in (0, 1499):
            os.symlink(victims.checkpoints, "ckpt_dir", dir_fd=folder)
            os.symlink(victims.checkpoints / "last.ckpt", "ckpt_file", dir_fd=folder)
            os.symlink(victims.root, "up", dir_fd=folder)
        os.mkdir("d", dir_fd=folder)
        inner = os.open("d", os.O_RDONLY, dir_fd=folder)
        os.close(folder)
        folder = inner
    os.close(folder)
    return planted


def _kill_during_a_run(tmpdir: Path) -> list[str]:
    """A trainer killed while its program runs: it leaves the run's folder (nothing ran its exit handlers)."""
    trainer = start_trainer(tmpdir, ["import time\ntime.sleep(3)"], "normally")
    assert trainer.stdout.readline() == "probed\n"
    deadline = time.monotonic() + 30
    while not any(name.startswith("gspo-sandbox-mnt-") for name in left_in(tmpdir)):
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.05)
    trainer.kill()
    trainer.communicate(timeout=30)
    return left_in(tmpdir)


def test_what_a_killed_trainer_left_is_removed_by_the_next_without_following_links(
    tmpdir_of_trainers, victims, monkeypatch
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir_of_trainers))
    held = hostdir.make_run_folder("run")  # a live trainer's folder, in use: never to be removed
    try:
        killed_runs = set(_kill_during_a_run(tmpdir_of_trainers)) - {held.path.name}
        assert len(killed_runs) == 1
        planted = _plant_abandoned_tree(tmpdir_of_trainers, victims)  # after: the killed trainer swept too
        assert planted.is_dir() and (planted / "work/ckpt_dir").is_symlink()
        trainer = start_trainer(tmpdir_of_trainers, ["print('ok')"], "normally")
        assert finish(trainer) == [[0, True, None, "ok\n"]]
        assert left_in(tmpdir_of_trainers) == [held.path.name]
        assert victims.changes() == {}
    finally:
        assert held.remove(time.monotonic() + 10)
    assert left_in(tmpdir_of_trainers) == []
