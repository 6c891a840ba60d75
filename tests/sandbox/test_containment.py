"""Fail closed: where a containment step is missing, ``required`` refuses and ``best_effort`` names what is missing.

The missing steps are simulated (the probe's answer is replaced); the runs that then happen are real, on the
fallback path, and are themselves checked against hostile programs.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path

import pytest

from gspo_lightning.sandbox import Sandbox, SandboxLimits, SandboxUnavailableError
from gspo_lightning.sandbox import sandbox as sandbox_module
from gspo_lightning.sandbox.containment import Containment, decide
from gspo_lightning.sandbox.hostdir import make_run_folder
from gspo_lightning.sandbox.spec import LaunchSpec
from gspo_lightning.sandbox.uids import lease_uid
from tests.sandbox.conftest import needs_isolation, needs_root, processes_of, run_launcher
from tests.sandbox.hostile import CLEANUP, ESCAPES

LIMITS = SandboxLimits(wall_time_s=2.0, cpu_time_s=1, memory_mb=256)
NO_NAMESPACES = "unshare: Operation not permitted (simulated)"
NO_FILTER = "seccomp: no filter for this architecture (simulated)"
NO_CGROUP = "no writable cgroup (simulated)"


def machine(monkeypatch, **missing: str) -> None:
    """Pretend this machine lacks the given steps (``namespaces=...``, ``seccomp=...``, ``cgroup=...`` ...)."""
    pretended = dataclasses.replace(sandbox_module.probe_containment(), **missing)
    monkeypatch.setattr(sandbox_module, "probe_containment", lambda: pretended)


def run(sandbox: Sandbox, code: str):
    return sandbox.run({"main.py": code}, "main.py")


@needs_isolation
def test_required_refuses_and_names_every_missing_step(monkeypatch):
    machine(monkeypatch, namespaces=NO_NAMESPACES, seccomp=NO_FILTER)
    with pytest.raises(SandboxUnavailableError) as refused:
        run(Sandbox(LIMITS), "print(1)")
    message = str(refused.value)
    assert "isolation='required'" in message and "best_effort" in message
    assert f"network/mount/PID namespaces and the minimal root: {NO_NAMESPACES}" in message
    assert f"the system-call filter (seccomp): {NO_FILTER}" in message


@needs_isolation
@needs_root
def test_required_refuses_without_per_run_uids_for_a_root_trainer(monkeypatch):
    machine(monkeypatch, uids="no folder for sandbox uid leases (simulated)")
    with pytest.raises(SandboxUnavailableError, match=r"per-run unprivileged uids: no folder .*simulated"):
        run(Sandbox(LIMITS), "print(1)")


@needs_isolation
def test_best_effort_says_exactly_what_is_missing_and_what_stands_in(monkeypatch):
    machine(monkeypatch, namespaces=NO_NAMESPACES, cgroup=NO_CGROUP)
    with pytest.warns(UserWarning) as caught:
        result = run(Sandbox(LIMITS, isolation="best_effort"), "print('ran')")
    message = str(caught[0].message)
    assert result.ok and result.stdout == "ran\n" and not result.isolated
    assert NO_NAMESPACES in message and "private folder on the host" in message
    assert NO_CGROUP in message and "memory_mb x processes" in message
    assert "seccomp" not in message  # the filter is there: it is not reported missing


@needs_isolation
def test_required_runs_without_a_cgroup_and_says_what_bounds_memory_instead(monkeypatch):
    machine(monkeypatch, cgroup=NO_CGROUP)
    with pytest.warns(UserWarning, match=r"per-run memory and process cgroup .*memory_mb x processes"):
        sandbox = Sandbox(LIMITS)
        result = run(sandbox, "print('ran')")
    assert result.ok and result.isolated
    bomb = run(sandbox, "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))")
    assert not bomb.ok and "MemoryError" in bomb.stderr  # the per-process bound stands in


def test_off_isolates_nothing_and_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = run(Sandbox(LIMITS, isolation="off"), "import os\nprint(os.getcwd() != '/work')")
    assert result.ok and result.stdout == "True\n" and not result.isolated


def test_decide_uses_every_step_that_is_there():
    everything = Containment(None, None, None, None)
    assert decide("required", everything, is_root=True) == decide("best_effort", everything, is_root=True)
    mode = decide("required", everything, is_root=False)
    assert mode.isolate and mode.seccomp and mode.cgroup and not mode.own_uids


# The fallback itself: no namespaces, but root's own uid, the cgroup and the filter still contain a program.
FALLBACK_CASES = [h for h in ESCAPES + CLEANUP if h.name in (
    "escape_setpgid_child", "daemon_outlives_a_quick_exit", "links_to_victims_left_behind", "deep_directories",
)]  # fmt: skip


@needs_isolation
@needs_root
@pytest.mark.parametrize("hostile", FALLBACK_CASES, ids=lambda h: h.name)
def test_the_fallback_without_namespaces_still_kills_everything_and_touches_nothing(monkeypatch, victims, hostile):
    machine(monkeypatch, namespaces=NO_NAMESPACES)
    with pytest.warns(UserWarning, match="without network/mount/PID namespaces"):
        sandbox = Sandbox(LIMITS, isolation="best_effort")
        sandbox.check()
    before = set(Path("/tmp").iterdir())
    result = run(sandbox, hostile.source.replace("VICTIMS", str(victims.root)) + "\nprint('done')")
    assert not result.isolated
    assert processes_of(set(sandbox.uids_used)) == []
    assert victims.changes() == {}
    # The run's own folder is gone; what the program itself put into the host's /tmp (it runs there without
    # namespaces, as the best_effort warning says) is not followed by the cleanup: the victims above are unchanged
    assert {p for p in set(Path("/tmp").iterdir()) - before if p.name.startswith("gspo-sandbox-")} == set()
    assert run(sandbox, "print('next')").stdout == "next\n"


@needs_root
def test_without_namespaces_the_launcher_kills_every_process_of_the_runs_uid():
    """Outside a PID namespace a process can leave the program's group and session; it cannot leave its uid.
    (The interpreter may be out of reach of other users here, so the program is a shell.)"""
    lease = lease_uid()
    private = make_run_folder("run", lease.uid)
    spec = LaunchSpec(
        isolate=False, seccomp=True, workdir=str(private.path / "work"), files={"note": ""},
        argv=["/bin/sh", "-c", "setsid sleep 60 & setsid sleep 60 & exec sleep 60"], env={"PATH": "/usr/bin:/bin"},
        run_as=(lease.uid, lease.uid), limits=SandboxLimits(wall_time_s=1.0),
    )  # fmt: skip
    try:
        completed, outcome = run_launcher(spec)
        assert completed.returncode == 0 and outcome.error is None and outcome.timed_out, completed.stderr
        assert processes_of({lease.uid}) == []
    finally:
        private.remove(time.monotonic() + 10)
        lease.release()
