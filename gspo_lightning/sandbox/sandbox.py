"""Run untrusted programs (model completions) contained, one launcher process per run.

A run: take a slot (an unprivileged uid leased machine-wide when the trainer is root, and a cgroup), describe
the run in a :class:`LaunchSpec`, start the launcher (``launcher/``) with the spec, the program's stdin and
empty stdout/stderr as memory files (nothing of a run is ever written to the host disk when it is isolated),
wait for it, read back what the program printed. The launcher only returns once every process of the run is
gone; the trainer then checks the slot's cgroup is empty before the slot serves another run.
What each containment step is and what happens without it: ``containment.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from gspo_lightning.sandbox.cgroups import (
    CgroupLimits,
    RunCgroup,
    cgroup_name,
    cgroup_unavailable_reason,
    find_hierarchies,
)
from gspo_lightning.sandbox.containment import ISOLATIONS, Containment, Isolation, RunMode, decide
from gspo_lightning.sandbox.hostdir import RunFolder, make_run_folder
from gspo_lightning.sandbox.root_plan import base_interpreter, minimal_root_plan, unreachable_by_others
from gspo_lightning.sandbox.spec import WORKDIR, LaunchSpec, Outcome, SandboxLimits
from gspo_lightning.sandbox.uids import UidLease, lease_uid

_LAUNCHER = str(Path(__file__).with_name("launcher"))
_LAUNCHER_GRACE_S = 10.0  # beyond wall_time_s: the launcher's start, the root's set-up, the namespace's teardown
_CLEANUP_S = 10.0  # at most this long removing a run's host folder; what is left is reported (and swept later)
_slot_names = itertools.count()


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one run.

    Attributes:
        exit_code: the program's exit status; ``128 + n`` when killed by signal n; None when it never ran.
        stdout, stderr: the first ``output_bytes`` of each, decoded as UTF-8 (invalid bytes replaced).
        timed_out: the wall-clock limit was reached and the run was killed.
        wall_s: seconds from start to end.
        isolated: the run had its namespaces, minimal root and system-call filter.
        error: why the program did not run (isolation or setup failure), else None.
        memory_exceeded: the run's memory cap killed one of its processes.
        output_truncated: stdout or stderr was longer than ``output_bytes``.
    """

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    isolated: bool
    error: str | None = None
    memory_exceeded: bool = False
    output_truncated: bool = False

    @property
    def ok(self) -> bool:
        """The program ran to completion and exited with status 0."""
        return self.exit_code == 0 and not self.timed_out and self.error is None


@dataclass
class _Slot:
    """What one concurrent run holds: its uid lease (trainer is root) and its cgroup (where there are any)."""

    uid: UidLease | None
    cgroup: RunCgroup | None

    def release(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.uid is not None:
            self.uid.release()


def _release_all(slots: list[_Slot]) -> None:
    for slot in slots:
        slot.release()
    slots.clear()


class Sandbox:
    """Runs Python programs contained (see ``containment.py`` for what that means on this machine).

    Args:
        limits: limits of each run.
        isolation: ``required`` (default) runs only with every containment step and raises
            ``SandboxUnavailableError`` at the first run where one is missing; ``best_effort`` runs with what
            the machine has and warns, naming what is missing; ``off`` never isolates: trusted code only.
    """

    def __init__(self, limits: SandboxLimits | None = None, isolation: Isolation = "required") -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"sandbox isolation must be one of {list(ISOLATIONS)}, got {isolation!r}")
        self.limits = limits or SandboxLimits()
        self.isolation = isolation
        self._mode: RunMode | None = None
        self._lock = threading.Lock()
        self._free: list[_Slot] = []
        self._slots: list[_Slot] = []
        self._uids_used: set[int] = set()
        self._finalizer = weakref.finalize(self, _release_all, self._slots)

    def __getstate__(self) -> dict:
        # picklable for process-isolated reward workers: slots and locks belong to one process
        return {"limits": self.limits, "isolation": self.isolation}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["limits"], state["isolation"])

    @property
    def uids_used(self) -> frozenset[int]:
        """Every uid this sandbox has run programs as (trainer running as root), for audits and tests."""
        return frozenset(self._uids_used)

    def check(self) -> bool:
        """Decide once what runs use; raise ``SandboxUnavailableError`` if required but impossible.

        Returns whether runs are isolated."""
        with self._lock:
            if self._mode is None:
                self._mode = decide(self.isolation, probe_containment(), is_root=os.getuid() == 0)
            return self._mode.isolate

    def run(self, files: dict[str, str], entry: str, stdin: str = "") -> SandboxResult:
        """Write ``files`` into a fresh working directory and run ``python <entry>`` there.

        Args:
            files: file name (relative, no ``..``) to text content; ``entry`` must be one of them.
            entry: the file to run.
            stdin: text fed to the program's standard input.
        """
        self.check()
        assert self._mode is not None
        return self._execute(files, entry, stdin, self._mode)

    def close(self) -> None:
        """Give back every uid and cgroup this sandbox holds (also done when it is garbage-collected)."""
        self._finalizer()

    def _execute(self, files: dict[str, str], entry: str, stdin: str, mode: RunMode) -> SandboxResult:
        if entry not in files:
            raise ValueError(f"entry {entry!r} is not among the files {sorted(files)}")
        for name in files:
            if name.startswith("/") or any(part in ("", ".", "..") for part in name.split("/")):
                raise ValueError(f"sandbox file name {name!r} leaves the working directory")
        slot = self._take_slot(mode)
        folder: RunFolder | None = None
        try:
            # one host folder per run, gone with it: isolated, the mount point of its tmpfs; else its files
            program_uid = slot.uid.uid if slot.uid else None
            folder = make_run_folder("root") if mode.isolate else make_run_folder("run", program_uid)
            return self._launch(self._spec(files, entry, mode, slot, folder.path), stdin, slot)
        finally:
            emptied = self._empty(slot)  # before its files are touched
            if folder is not None and not folder.remove(time.monotonic() + _CLEANUP_S):
                raise RuntimeError(f"sandbox folder {folder.path} could not be removed within {_CLEANUP_S} s")
            self._give_back(slot, emptied)

    def _spec(self, files: dict, entry: str, mode: RunMode, slot: _Slot, folder: Path) -> LaunchSpec:
        workdir = WORKDIR if mode.isolate else str(folder / "work")
        python = sys.executable if self.isolation == "off" else base_interpreter()  # off: trusted, its packages
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": "/tmp" if mode.isolate else workdir,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "MALLOC_ARENA_MAX": "2",  # each malloc arena reserves 64 MiB of address space: threads would run out
        }
        return LaunchSpec(
            isolate=mode.isolate,
            seccomp=mode.seccomp,
            workdir=workdir,
            files=dict(files),
            argv=[python, "-I", entry],
            env=env,
            run_as=(slot.uid.uid, slot.uid.uid) if slot.uid else None,
            limits=self.limits,
            cgroup_procs=slot.cgroup.procs_files if slot.cgroup else (),
            root=dataclasses.replace(minimal_root_plan(), mount_point=str(folder)) if mode.isolate else None,
        )

    def _launch(self, spec: LaunchSpec, stdin: str, slot: _Slot) -> SandboxResult:
        streams = [_memory_file("stdin", stdin.encode()), _memory_file("stdout"), _memory_file("stderr")]
        spec_file, status = _memory_file("spec", spec.to_wire()), _memory_file("status")
        held = [spec_file, status] + ([slot.uid.descriptor] if slot.uid else [])
        oom_before = slot.cgroup.oom_kills() if slot.cgroup else 0
        start = time.monotonic()
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", _LAUNCHER, *map(str, held)],
                stdin=streams[0],
                stdout=streams[1],
                stderr=streams[2],
                pass_fds=held,
                env={"PATH": "/usr/bin:/bin"},
                close_fds=True,
                start_new_session=True,  # a signal meant for the trainer's terminal does not reach it
            )
            if not _exited_within(process, spec.limits.wall_time_s + _LAUNCHER_GRACE_S):
                process.kill()  # never expected; killing it takes the run's init, so the whole run, with it
                process.wait()
            wall = time.monotonic() - start
            outcome = Outcome.from_wire(os.pread(status, 1 << 16, 0))
            stdout, stderr, truncated = _read_outputs(streams[1], streams[2], spec.limits.output_bytes)
        finally:
            for descriptor in (*streams, spec_file, status):
                os.close(descriptor)
        memory_exceeded = slot.cgroup is not None and slot.cgroup.oom_kills() > oom_before
        if outcome.error is None and outcome.exit_code is None:
            outcome.error = f"sandbox launcher failed (exit status {process.returncode}): {stderr.strip()[-500:]}"
        return SandboxResult(
            outcome.exit_code if outcome.error is None else None,
            stdout,
            stderr,
            outcome.timed_out,
            wall,
            spec.isolate,
            outcome.error,
            memory_exceeded,
            truncated,
        )

    def _take_slot(self, mode: RunMode) -> _Slot:
        with self._lock:
            if self._free:
                return self._free.pop()
        uid = lease_uid() if mode.own_uids else None
        try:
            cgroup = self._make_cgroup() if mode.cgroup else None
        except BaseException:
            if uid is not None:
                uid.release()
            raise
        slot = _Slot(uid, cgroup)
        with self._lock:
            self._slots.append(slot)
            if uid is not None:
                self._uids_used.add(uid.uid)
        return slot

    def _make_cgroup(self) -> RunCgroup:
        limits = CgroupLimits(self.limits.memory_mb * 2**20, self.limits.processes)
        return RunCgroup(cgroup_name(os.getpid(), next(_slot_names)), find_hierarchies()[0], limits)

    def _empty(self, slot: _Slot) -> bool:
        """Whether the slot's cgroup is empty (after killing what is left: nothing, unless not isolated)."""
        return slot.cgroup is None or slot.cgroup.empty(time.monotonic() + 5)

    def _give_back(self, slot: _Slot, emptied: bool) -> None:
        with self._lock:
            if emptied:
                self._free.append(slot)
                return
            self._slots.remove(slot)
        slot.release()
        raise RuntimeError(f"processes were left in the sandbox cgroup {slot.cgroup.folders} after a run")


def _exited_within(process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for ``process``; woken by its exit (a pidfd), not by polling as ``Popen.wait(timeout)`` does."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):  # Linux < 5.3
        try:
            process.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
    finally:
        os.close(pidfd)
    if ready:
        process.wait()
    return bool(ready)


def _memory_file(name: str, content: bytes = b"") -> int:
    """An anonymous in-memory file (closed on exec unless handed over), positioned at its start."""
    descriptor = os.memfd_create(f"gspo-sandbox-{name}")
    if content:
        os.write(descriptor, content)
        os.lseek(descriptor, 0, os.SEEK_SET)
    return descriptor


def _read_outputs(stdout: int, stderr: int, limit: int) -> tuple[str, str, bool]:
    texts, truncated = [], False
    for descriptor in (stdout, stderr):
        texts.append(os.pread(descriptor, limit, 0).decode("utf-8", errors="replace"))
        truncated = truncated or os.fstat(descriptor).st_size > limit
    return texts[0], texts[1], truncated


@functools.lru_cache(maxsize=1)
def probe_containment() -> Containment:
    """What this machine provides (probed once per process, with trivial programs)."""
    if not sys.platform.startswith("linux"):
        reason = f"Linux only (this is {sys.platform})"
        return Containment(reason, reason, reason, reason)
    uids, root = None, os.getuid() == 0
    if root:
        try:
            lease_uid().release()
        except (OSError, RuntimeError) as error:
            uids = str(error)
    namespaces = _probe_run(isolate=True, seccomp=False, own_uids=root and uids is None)
    isolated = namespaces is None  # outside namespaces another uid may not reach the interpreter: not tried
    seccomp = _probe_run(isolate=isolated, seccomp=True, own_uids=root and uids is None and isolated)
    return Containment(namespaces, seccomp, cgroup_unavailable_reason(), uids, unreachable_by_others())


def _probe_run(isolate: bool, seccomp: bool, own_uids: bool) -> str | None:
    """None when a trivial program runs in that mode, else why not."""
    mode = RunMode(isolate=isolate, seccomp=seccomp, cgroup=False, own_uids=own_uids)
    probe = Sandbox(SandboxLimits(wall_time_s=30), isolation="best_effort")  # its mode is given, not probed
    try:
        result = probe._execute({"probe.py": "print('ok')"}, "probe.py", "", mode)
    except (OSError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        probe.close()
    if result.error is not None:
        return result.error
    if not result.ok or result.stdout.strip() != "ok":
        return f"a trivial program failed (exit {result.exit_code}): {result.stderr.strip()[-500:]}"
    return None


def isolation_unavailable_reason() -> str | None:
    """None when isolated, filtered runs work on this machine, else why not."""
    containment = probe_containment()
    return containment.namespaces or containment.seccomp
