"""What the trainer tells the launcher about a run (limits, plan), and what it hears back (the outcome).

The launcher reads the same field names from the wire form (``launcher/wire.py``): keep the two in step.
"""

from __future__ import annotations

import marshal
from dataclasses import asdict, dataclass

from gspo_lightning.sandbox.launcher.wire import read_outcomes

WORKDIR = "/work"
"""The program's working directory as it sees it, when isolated."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use.

    Attributes:
        wall_time_s: wall-clock seconds before the run (every process it started) is killed.
        cpu_time_s: CPU seconds per process (SIGXCPU, then SIGKILL one second later).
        memory_mb: memory of the whole run, in MiB: its cgroup's ``memory.max`` (every process, the files it
            writes, its output). Where no cgroup can be made, the address space of each process instead
            (``RLIMIT_AS``), so a run is bounded by ``memory_mb x processes`` plus its disk.
        file_size_mb: largest file the program may write (stdout and stderr included), in MiB.
        output_bytes: how much of stdout and of stderr is read back.
        processes: most processes and threads of the run at once (``pids.max`` and ``RLIMIT_NPROC``).
        open_files: most open file descriptors per process.
        disk_mb: bytes the run may write to its working directory and ``/tmp`` together, in MiB.
        max_files: files and folders the run may create there.
    """

    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_mb: int = 512
    file_size_mb: int = 16
    output_bytes: int = 1 << 20
    processes: int = 64
    open_files: int = 64
    disk_mb: int = 64
    max_files: int = 4096

    def __post_init__(self) -> None:
        problem = limits_problem(asdict(self))
        if problem is not None:
            raise ValueError(f"sandbox limit {problem}")


MINIMUM_MEMORY_MB = 64  # a Python interpreter needs about this much address space to start


def limits_problem(values: dict) -> str | None:
    """What is wrong with a set of limit values (``"<name> must be ..., got ..."``), or None."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            return f"{name} must be a positive number, got {value!r}"
        if name != "wall_time_s" and not isinstance(value, int):
            return f"{name} must be a whole number, got {value!r}"
    if values.get("memory_mb", MINIMUM_MEMORY_MB) < MINIMUM_MEMORY_MB:
        return f"memory_mb must be >= {MINIMUM_MEMORY_MB} (a Python interpreter needs it), got {values['memory_mb']}"
    return None


@dataclass(frozen=True)
class RootPlan:
    """The minimal root an isolated program sees: what of the host is bound into it, read-only, and where.

    Attributes:
        mount_point: the run's own empty host folder its tmpfs is mounted on (in its private mount namespace);
            empty in the cached plan, set per run.
        binds: host files and folders bound read-only at the same path (the interpreter, its standard library,
            the folders of the shared libraries it loads).
        symlinks: ``(path, link text)`` pairs recreated so that paths the loader uses resolve (``/lib`` ...).
        masks: folders inside ``binds`` hidden behind an empty read-only tmpfs (third-party packages).
        devices: device nodes bound in.
    """

    mount_point: str
    binds: tuple[str, ...]
    symlinks: tuple[tuple[str, str], ...]
    masks: tuple[str, ...]
    devices: tuple[str, ...] = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")


@dataclass(frozen=True)
class LaunchSpec:
    """Everything the launcher needs to start one program.

    Attributes:
        isolate: enter new namespaces and the minimal root ``root``; else run in ``workdir`` on the host.
        seccomp: install the system-call filter (no namespaces, mounts, keyrings, ptrace, bpf ...).
        workdir: the program's working directory as it sees it.
        files: name -> text, written into ``workdir`` by the launcher (isolated runs) before the program starts.
        argv, env: what is executed.
        run_as: ``(uid, gid)`` the program switches to (a trainer running as root), else None.
        limits: the run's limits.
        cgroup_procs: ``cgroup.procs`` files of the run's cgroups, which the program joins before it starts.
        root: the minimal root (isolated runs).
    """

    isolate: bool
    seccomp: bool
    workdir: str
    files: dict[str, str]
    argv: list[str]
    env: dict[str, str]
    run_as: tuple[int, int] | None
    limits: SandboxLimits
    cgroup_procs: tuple[str, ...] = ()
    root: RootPlan | None = None

    def to_wire(self) -> bytes:
        return marshal.dumps(asdict(self))


@dataclass
class Outcome:
    """What the launcher reports: why nothing ran, or how the program ended.

    Attributes:
        stage: ``isolation`` or ``setup`` when nothing ran (see ``error``), else None.
        error: why nothing ran.
        exit_code: the program's exit status; ``128 + n`` when it was killed by signal n.
        timed_out: the wall-clock limit was reached and the run was killed.
    """

    stage: str | None = None
    error: str | None = None
    exit_code: int | None = None
    timed_out: bool = False

    @classmethod
    def from_wire(cls, data: bytes) -> Outcome:
        """The launcher's last record wins; a setup error recorded earlier (by init or the program) is kept."""
        outcome = cls()
        for record in read_outcomes(data):
            error = record.get("error") or outcome.error
            stage = record.get("stage") or outcome.stage
            outcome = cls(stage, error, record.get("exit_code"), bool(record.get("timed_out")))
        return outcome
