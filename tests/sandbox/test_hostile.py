"""Hostile programs, each scored in a batch next to honest ones, as the code reward would see them in a rollout.

Each must score 0, leave no process behind, change nothing outside its run (the victims' files and their
modes), let the batch's other samples score normally, and leave its slot fit for honest programs after it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gspo_lightning.rewards.code import CodeTests
from gspo_lightning.sandbox import Sandbox, SandboxLimits, SandboxResult
from tests.sandbox.conftest import (
    ADD_TESTS,
    HONEST_ADD,
    ROOT,
    SAMPLE,
    SLOW_HONEST_ADD,
    THREADED_HONEST_ADD,
    Victims,
    needs_isolation,
    needs_root,
    processes_of,
    sandbox_uids,
)
from tests.sandbox.hostile import CLEANUP, ESCAPES, READING, Hostile
from tests.sandbox.hostile_caps import DISK, MEMORY, MORE, NETWORK, OUTPUTS

pytestmark = needs_isolation

ALL = ESCAPES + CLEANUP + READING + OUTPUTS + MEMORY + NETWORK + DISK + MORE
MEMORY_MB, DISK_MB, MAX_FILES = 256, 32, 1000
# an account of this host other than the two the sandbox's own /etc/passwd lists
HOST_ACCOUNT = next(
    name
    for name in (line.split(":")[0] for line in Path("/etc/passwd").read_text().splitlines())
    if name not in ("root", "sandbox")
)


@pytest.fixture(scope="module")
def reward() -> CodeTests:
    return CodeTests(
        wall_time_s=1.5, cpu_time_s=1, memory_mb=MEMORY_MB, disk_mb=DISK_MB, max_files=MAX_FILES, max_workers=3
    )


@pytest.fixture(autouse=True)
def _no_leftovers_reach_the_next_test(reward):
    """Hygiene, not containment (each test asserts that itself): one failure must not cascade."""
    yield
    for pid in processes_of(sandbox_uids(reward.sandbox)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def fill(source: str, victims: Victims) -> str:
    values = {
        "VICTIMS": str(victims.root),
        "ABSTRACT": victims.abstract_socket,
        "SAMPLE": str(SAMPLE),
        "PROJECT": str(ROOT),
        "VENV": sys.prefix,
        "TRAINER_PID": str(os.getpid()),
        "DISK_MB": str(DISK_MB),
        "MAX_FILES": str(MAX_FILES),
        "MEMORY_MB": str(MEMORY_MB),
        "HOST_ACCOUNT": HOST_ACCOUNT,
    }
    for placeholder, value in values.items():
        source = source.replace(placeholder, value)
    return source


def score(reward: CodeTests, programs: list[str]) -> list[float]:
    count = len(programs)
    return reward(["p"] * count, programs, tests=[ADD_TESTS] * count, entry_point=["add"] * count)


def files_owned_by(uids: set[int], folder: Path) -> list[Path]:
    return [path for path in folder.iterdir() if path.lstat().st_uid in uids]


def assert_contained(reward: CodeTests, victims: Victims) -> None:
    """No process of any run is left, nothing outside changed, and every slot still runs honest programs."""
    uids = sandbox_uids(reward.sandbox)
    assert processes_of(uids) == [], "a program's processes outlived its run"
    assert victims.changes() == {}, "a file outside the run was changed"
    assert files_owned_by(uids, Path("/tmp")) == [], "a run left files in /tmp"
    assert score(reward, [THREADED_HONEST_ADD] * 3) == [1.0] * 3, "an honest program failed after the attack"


def _param(hostile: Hostile):
    return pytest.param(hostile, id=hostile.name, marks=[pytest.mark.slow] if hostile.slow else [])


@pytest.mark.parametrize("hostile", [_param(h) for h in ALL])
def test_a_hostile_program_scores_zero_and_its_batch_is_scored_normally(reward, victims, hostile):
    # A copier needs a sibling still running while it looks around; the others get a quick one.
    sibling = SLOW_HONEST_ADD if hostile.threat.startswith("3 reward hacking") else HONEST_ADD
    scores = score(reward, [fill(hostile.source, victims), sibling, HONEST_ADD])
    assert scores == [0.0, 1.0, 1.0], f"{hostile.name} ({hostile.threat})"
    assert_contained(reward, victims)


def test_the_suite_covers_every_threat_class_with_at_least_25_programs():
    classes = {hostile.threat.split()[0] for hostile in ALL}
    assert {"1", "2", "3", "4", "5", "6", "7"} <= classes
    assert len(ALL) >= 25


# Holds all but one of its uid's process slots for a while, as escaped or busy children would.
HOLDER = (
    "import os, time\nfor _ in range(PROCESSES - 1):\n    if os.fork() == 0:\n        time.sleep(3)\n"
    "        os._exit(0)\ntime.sleep(3)\n"
)
THREADS = (
    "import threading\nts = [threading.Thread(target=int) for _ in range(8)]\n[t.start() for t in ts]\n"
    "[t.join() for t in ts]\nprint('ok')\n"
)


def _honest_run_while_holding(holder_sandbox_run, honest_sandbox: Sandbox) -> SandboxResult:
    with ThreadPoolExecutor(1) as pool:
        holding = pool.submit(holder_sandbox_run)
        time.sleep(1.0)  # the holder's children are up
        result = honest_sandbox.run({"main.py": THREADS}, "main.py")
        holding.result()
    return result


@needs_root
def test_two_sandboxes_in_one_process_never_share_a_uid():
    """The rollout's and the evaluation's CodeTests each have a Sandbox: one's processes must not count
    against the other's process limit."""
    limits = SandboxLimits(wall_time_s=6.0, processes=16)
    holder, honest = Sandbox(limits), Sandbox(limits)
    program = {"main.py": HOLDER.replace("PROCESSES", "16")}
    result = _honest_run_while_holding(lambda: holder.run(program, "main.py"), honest)
    assert result.ok and result.stdout == "ok\n", result.stderr[-500:]
    assert not set(holder.uids_used) & set(honest.uids_used)


@needs_root
def test_sandboxes_in_two_processes_never_share_a_uid():
    limits = SandboxLimits(wall_time_s=6.0, processes=16)
    code = (
        "import os, sys, types\n"  # the sandbox package alone, without the trainer's heavy imports
        "package = types.ModuleType('gspo_lightning')\n"
        "package.__path__ = [os.path.join(sys.argv[1], 'gspo_lightning')]\n"
        "sys.modules['gspo_lightning'] = package\n"
        "from gspo_lightning.sandbox import Sandbox, SandboxLimits\n"
        "box = Sandbox(SandboxLimits(wall_time_s=6.0, processes=16))\n"
        f"box.run({{'main.py': {HOLDER.replace('PROCESSES', '16')!r}}}, 'main.py')\n"
        "print(sorted(box.uids_used))\n"
    )
    other = subprocess.Popen([sys.executable, "-c", code, str(ROOT)], stdout=subprocess.PIPE, text=True)
    time.sleep(2.0)  # it has imported the sandbox and its holder is running
    honest = Sandbox(limits)
    result = honest.run({"main.py": THREADS}, "main.py")
    their_uids = other.communicate(timeout=60)[0]
    assert result.ok and result.stdout == "ok\n", result.stderr[-500:]
    assert not set(json.loads(their_uids)) & set(honest.uids_used)
