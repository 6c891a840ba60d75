"""Per-run cgroups: one memory cap and one process cap over every process of a run, however many it forks.

Each sandbox slot (one concurrent run) has its own cgroup, made below the trainer's own (so the trainer's limits
still hold), with ``memory.max`` / ``memory.limit_in_bytes`` (swap included where the kernel counts it) and
``pids.max``, and reused run after run. The program joins it before it starts; every process it then creates
inherits it and nothing in the sandbox can leave it. Memory counts the program's pages, the files it writes
(its tmpfs) and its output (memory files): all charged to the cgroup.

cgroup v2 is used where the trainer's cgroup may delegate the ``memory`` and ``pids`` controllers to children
(the root cgroup, a delegated subtree); else the v1 ``memory`` and ``pids`` hierarchies where they are mounted
and writable; else none, and :func:`cgroup_unavailable_reason` says why (the run is then bounded by
``RLIMIT_AS x RLIMIT_NPROC``).
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

_CONTROLLERS = ("memory", "pids")


@dataclass(frozen=True)
class Hierarchy:
    """Where one controller's per-run cgroups go: the parent folder, and the cgroup version there."""

    controller: str
    parent: Path
    version: int


@dataclass(frozen=True)
class CgroupLimits:
    memory_bytes: int
    processes: int


class RunCgroup:
    """The cgroups of one sandbox slot (one per controller hierarchy); empty between runs."""

    def __init__(self, name: str, hierarchies: tuple[Hierarchy, ...], limits: CgroupLimits) -> None:
        self.folders = [hierarchy.parent / name for hierarchy in hierarchies]
        self._hierarchies = hierarchies
        for hierarchy, folder in zip(hierarchies, self.folders, strict=True):
            if folder.exists():  # left by a dead trainer whose pid this one has now: take it over, emptied
                _kill_members(folder, deadline=time.monotonic() + 5)
            else:
                folder.mkdir()
            _write_limits(hierarchy, folder, limits)

    @property
    def procs_files(self) -> tuple[str, ...]:
        """Files a process writes ``0`` to, to join."""
        return tuple(str(folder / "cgroup.procs") for folder in self.folders)

    def oom_kills(self) -> int:
        """How many processes the memory cap has killed in this slot so far."""
        for hierarchy, folder in zip(self._hierarchies, self.folders, strict=True):
            if hierarchy.controller == "memory":
                name = "memory.events" if hierarchy.version == 2 else "memory.oom_control"
                return _counter(folder / name, "oom_kill")
        return 0

    def empty(self, deadline: float) -> bool:
        """Kill whatever is still in the slot (nothing should be); True once it is empty."""
        return all(_kill_members(folder, deadline) for folder in self.folders)

    def remove(self) -> None:
        for folder in self.folders:
            try:
                folder.rmdir()
            except OSError:
                pass


def _write_limits(hierarchy: Hierarchy, folder: Path, limits: CgroupLimits) -> None:
    if hierarchy.controller == "pids":
        (folder / "pids.max").write_text(str(limits.processes))
    elif hierarchy.version == 2:
        (folder / "memory.max").write_text(str(limits.memory_bytes))
        _write_if_present(folder / "memory.swap.max", "0")
    else:
        (folder / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
        _write_if_present(folder / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))


def _write_if_present(path: Path, value: str) -> None:
    if path.exists():
        path.write_text(value)


def _counter(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except OSError:
        pass
    return 0


def _kill_members(folder: Path, deadline: float) -> bool:
    """SIGKILL every process in ``folder`` until none is left or ``deadline`` passes."""
    kill_file = folder / "cgroup.kill"
    while True:
        try:
            members = [int(pid) for pid in (folder / "cgroup.procs").read_text().split()]
        except OSError:
            return True
        if not members:
            return True
        if time.monotonic() > deadline:
            return False
        if kill_file.exists():
            kill_file.write_text("1")
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _own_cgroups() -> dict[str, str]:
    """Controller name (``""`` for v2) -> this process's cgroup path, from ``/proc/self/cgroup``."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, super options) of every cgroup mount."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        fstype, options = fields[separator + 1], set(fields[separator + 3].split(","))
        if fstype in ("cgroup", "cgroup2"):
            found.append((fields[4], fstype, options))
    return found


def _v2_parent(controller: str, own: dict[str, str], mounts: list) -> Path | None:
    for point, fstype, _ in mounts:
        if fstype != "cgroup2" or "" not in own:
            continue
        parent = Path(point + own[""].rstrip("/"))
        try:
            if controller not in (parent / "cgroup.controllers").read_text().split():
                continue
            if controller not in (parent / "cgroup.subtree_control").read_text().split():
                (parent / "cgroup.subtree_control").write_text(f"+{controller}")
        except OSError:  # not delegated to us, or the cgroup has processes of its own (v2 forbids it)
            continue
        return parent
    return None


def _v1_parent(controller: str, own: dict[str, str], mounts: list) -> Path | None:
    for point, fstype, options in mounts:
        if fstype == "cgroup" and controller in options and controller in own:
            parent = Path(point + own[controller].rstrip("/"))
            if os.access(parent, os.W_OK):
                return parent
    return None


@functools.lru_cache(maxsize=1)
def find_hierarchies() -> tuple[tuple[Hierarchy, ...], str | None]:
    """Where this machine lets per-run cgroups be made, or why not (probed once per process)."""
    if not Path("/proc/self/cgroup").exists():
        return (), "no cgroups on this system"
    own, mounts = _own_cgroups(), _mounts()
    found, missing = [], []
    for controller in _CONTROLLERS:
        v2 = _v2_parent(controller, own, mounts)
        parent = v2 or _v1_parent(controller, own, mounts)
        if parent is None:
            missing.append(controller)
        else:
            found.append(Hierarchy(controller, parent, 2 if v2 else 1))
    if missing:
        return (), (
            f"no writable cgroup with the {' and '.join(missing)} controller below this process's own "
            "(cgroup v2 needs them delegated to it, v1 needs write access to its hierarchies)"
        )
    reason = _try_one(tuple(found))
    if reason is not None:
        return (), reason
    for hierarchy in found:
        _remove_stale(hierarchy.parent)
    return tuple(found), None


def cgroup_name(owner_pid: int, slot: int) -> str:
    """The name of a slot's cgroup: its trainer's pid, so that a dead trainer's cgroups can be told and removed."""
    return f"gspo-sandbox-{owner_pid}-{slot}"


def _remove_stale(parent: Path) -> None:
    """Remove the cgroups of trainers that died without removing theirs (killed, not shut down)."""
    for folder in parent.glob("gspo-sandbox-*-*"):
        owner = folder.name.split("-")[2]
        if owner.isdigit() and not _alive(int(owner)):
            _kill_members(folder, deadline=time.monotonic() + 5)
            try:
                folder.rmdir()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _try_one(hierarchies: tuple[Hierarchy, ...]) -> str | None:
    probe = cgroup_name(os.getpid(), -1)
    try:
        RunCgroup(probe, hierarchies, CgroupLimits(64 * 2**20, 8)).remove()
    except OSError as error:
        return f"could not make a cgroup ({error.strerror or errno.errorcode.get(error.errno)}: {error.filename})"
    return None


def cgroup_unavailable_reason() -> str | None:
    """None when per-run cgroups work here, else why not."""
    return find_hierarchies()[1]
