"""Run untrusted programs (model completions) in a contained child process.

Each run gets its own private temporary directory: a working directory the program may write to (the only
writable place it sees when isolated), and the trainer's own files for its stdin, stdout and stderr, which the
program holds only as open descriptors. The directory is removed afterwards, whatever the program did.
See ``launcher.py`` for what isolation means; the limits below apply in every mode.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from gspo_lightning.sandbox.launcher import ISOLATION_FAILED, SETUP_FAILED

Isolation = Literal["required", "best_effort", "off"]
ISOLATIONS: tuple[str, ...] = ("required", "best_effort", "off")

_LAUNCHER = str(Path(__file__).with_name("launcher.py"))
_PYTHON_MOUNT = ".python"
# Unprivileged uids for programs when the trainer runs as root: far above any real account, one per concurrent
# run of this process, so runs cannot signal each other or share a process-count limit.
_UID_BASE = 1 << 20
_UIDS_PER_PROCESS = 256


class SandboxUnavailableError(RuntimeError):
    """Isolation was required, and this machine cannot provide it."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use.

    Attributes:
        wall_time_s: wall-clock seconds before the program (and everything it started) is killed.
        cpu_time_s: CPU seconds (SIGXCPU, then SIGKILL one second later).
        memory_mb: address-space limit per process, in MiB.
        file_size_mb: largest file the program may write (stdout and stderr included), in MiB.
        output_bytes: how much of stdout and of stderr is read back.
        processes: most processes (threads count) the program's user may have at once.
        open_files: most open file descriptors per process.
    """

    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_mb: int = 512
    file_size_mb: int = 16
    output_bytes: int = 1 << 20
    processes: int = 32
    open_files: int = 64

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"sandbox limit {name} must be a positive number, got {value!r}")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox limit memory_mb must be >= 64 (a Python interpreter needs it), got {self.memory_mb}")


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one run.

    Attributes:
        exit_code: the program's exit status; ``128 + n`` when killed by signal n; None when it never ran.
        stdout, stderr: the first ``output_bytes`` of each, decoded as UTF-8 (invalid bytes replaced).
        timed_out: the wall-clock limit was reached and the program was killed.
        wall_s: seconds from start to end.
        isolated: the run had network, mount and PID isolation.
        error: why the program did not run (isolation or setup failure), else None.
    """

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float
    isolated: bool
    error: str | None = None

    @property
    def ok(self) -> bool:
        """The program ran to completion and exited with status 0."""
        return self.exit_code == 0 and not self.timed_out and self.error is None


class Sandbox:
    """Runs Python programs contained: separate process, limits, no network, throw-away working directory.

    Args:
        limits: resource limits of each run.
        isolation: ``required`` (default) runs only with network, mount and PID namespaces and raises
            ``SandboxUnavailableError`` at the first run where the OS does not allow them; ``best_effort`` falls
            back to limits only (with a warning); ``off`` never isolates: only for trusted code.
    """

    def __init__(self, limits: SandboxLimits | None = None, isolation: Isolation = "required") -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"sandbox isolation must be one of {list(ISOLATIONS)}, got {isolation!r}")
        self.limits = limits or SandboxLimits()
        self.isolation = isolation
        self._isolate: bool | None = None if isolation != "off" else False
        self._lock = threading.Lock()
        self._free_slots = list(range(_UIDS_PER_PROCESS))

    def __getstate__(self) -> dict:
        # picklable for process-isolated reward workers: locks and slots are per process
        return {"limits": self.limits, "isolation": self.isolation}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["limits"], state["isolation"])

    def check(self) -> bool:
        """Decide once whether runs are isolated; raise ``SandboxUnavailableError`` if required but impossible."""
        with self._lock:
            if self._isolate is None:
                reason = isolation_unavailable_reason()
                if reason is not None and self.isolation == "required":
                    raise SandboxUnavailableError(
                        f"sandbox isolation='required' but network/mount/PID namespaces are not available here: "
                        f"{reason}. Run as root or allow unprivileged user namespaces "
                        "(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0), or set "
                        "isolation: best_effort (limits only) if the programs are trusted"
                    )
                if reason is not None:
                    warnings.warn(f"sandbox runs without isolation (isolation='best_effort'): {reason}", stacklevel=2)
                self._isolate = reason is None
            return self._isolate

    def run(self, files: dict[str, str], entry: str, stdin: str = "") -> SandboxResult:
        """Write ``files`` into a fresh working directory and run ``python <entry>`` there.

        Args:
            files: file name (relative, no ``..``) to text content; ``entry`` must be one of them.
            entry: the file to run.
            stdin: text fed to the program's standard input.
        """
        return self._execute(files, entry, stdin, self.check())

    def _execute(self, files: dict[str, str], entry: str, stdin: str, isolate: bool) -> SandboxResult:
        if entry not in files:
            raise ValueError(f"entry {entry!r} is not among the files {sorted(files)}")
        slot = self._take_slot()
        private = Path(tempfile.mkdtemp(prefix="gspo-sandbox-"))
        try:
            return self._run_in(private, files, entry, stdin, isolate, slot)
        finally:
            _remove_tree(private)
            self._give_back_slot(slot)

    def _run_in(
        self, private: Path, files: dict[str, str], entry: str, stdin: str, isolate: bool, slot: int
    ) -> SandboxResult:
        workdir = private / "work"
        workdir.mkdir()
        (workdir / _PYTHON_MOUNT).mkdir()
        for name, text in files.items():
            target = (workdir / name).resolve()
            if workdir.resolve() not in target.parents:
                raise ValueError(f"sandbox file name {name!r} leaves the working directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        run_as = _unprivileged_ids(slot) if isolate and os.getuid() == 0 else None
        _prepare_permissions(private, workdir, run_as)
        (private / "stdin").write_text(stdin)
        spec = self._spec(workdir, entry, isolate, run_as)
        start = time.monotonic()
        with (
            open(private / "stdin", "rb") as stdin_file,
            open(private / "stdout", "wb") as stdout_file,
            open(private / "stderr", "wb") as stderr_file,
        ):
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", _LAUNCHER, json.dumps(spec)],
                stdin=stdin_file,
                stdout=stdout_file,
                stderr=stderr_file,
                env={"PATH": "/usr/bin:/bin"},
                start_new_session=True,  # its own process group, killed as a whole
                close_fds=True,
            )
            exit_code, timed_out = _wait_or_kill(process, self.limits.wall_time_s)
        wall = time.monotonic() - start
        stdout, stderr = (_read_start(private / name, self.limits.output_bytes) for name in ("stdout", "stderr"))
        error = None
        if exit_code == ISOLATION_FAILED and isolate:
            error, exit_code = f"isolation failed: {stderr.strip()}", None
        elif exit_code == SETUP_FAILED and stderr.startswith("sandbox "):
            error, exit_code = stderr.strip(), None
        return SandboxResult(exit_code, stdout, stderr, timed_out, wall, isolate, error)

    def _spec(self, workdir: Path, entry: str, isolate: bool, run_as: tuple[int, int] | None) -> dict:
        if isolate:  # the program sees the base interpreter through a read-only bind mount
            version = f"python{sys.version_info.major}.{sys.version_info.minor}"
            python = str(workdir / _PYTHON_MOUNT / "bin" / version)
        else:
            python = sys.executable
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(workdir),
            "TMPDIR": str(workdir),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
        }
        return {
            "isolate": isolate,
            "workdir": str(workdir),
            "python_prefix": sys.base_prefix,
            "argv": [python, "-I", entry],
            "env": env,
            "run_as": run_as,
            "limits": asdict(self.limits),
        }

    def _take_slot(self) -> int:
        with self._lock:
            if not self._free_slots:
                raise RuntimeError(f"more than {_UIDS_PER_PROCESS} concurrent sandbox runs in one Sandbox")
            return self._free_slots.pop()

    def _give_back_slot(self, slot: int) -> None:
        with self._lock:
            self._free_slots.append(slot)


def _unprivileged_ids(slot: int) -> tuple[int, int]:
    uid = _UID_BASE + (os.getpid() % 4096) * _UIDS_PER_PROCESS + slot
    return uid, uid


def _prepare_permissions(private: Path, workdir: Path, run_as: tuple[int, int] | None) -> None:
    """The program's user owns its working directory and may pass through (not list) the private one."""
    if run_as is None:
        return
    private.chmod(stat.S_IRWXU | stat.S_IXGRP | stat.S_IXOTH)  # 0o711
    for path in [workdir, *workdir.rglob("*")]:
        if path.name != _PYTHON_MOUNT or path.parent != workdir:
            os.chown(path, *run_as)


def _wait_or_kill(process: subprocess.Popen, wall_time_s: float) -> tuple[int, bool]:
    try:
        return process.wait(timeout=wall_time_s), False
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        return process.wait(), True


def _kill_group(pid: int) -> None:
    # Killing the launcher also kills the program (parent-death signal) and, when isolated, its whole PID
    # namespace; the group kill reaches the rest when not isolated.
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read_start(path: Path, limit: int) -> str:
    with open(path, "rb") as handle:
        return handle.read(limit).decode("utf-8", errors="replace")


def _remove_tree(path: Path) -> None:
    """Remove ``path`` even if the program left unreadable or unwritable directories in it."""

    def make_writable_and_retry(function, failed_path, _):
        parent = os.path.dirname(failed_path)
        for target in (parent, failed_path):
            try:
                os.chmod(target, stat.S_IRWXU)
            except OSError:
                pass
        function(failed_path)

    shutil.rmtree(path, onerror=make_writable_and_retry)


_PROBE_LOCK = threading.Lock()
_PROBE_RESULT: list[str | None] = []


def isolation_unavailable_reason() -> str | None:
    """None when isolated runs work on this machine, else why not (probed once per process)."""
    with _PROBE_LOCK:
        if not _PROBE_RESULT:
            _PROBE_RESULT.append(_probe_isolation())
        return _PROBE_RESULT[0]


def _probe_isolation() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"namespaces are Linux-only (this is {sys.platform})"
    probe = Sandbox(SandboxLimits(wall_time_s=30))
    result = probe._execute({"probe.py": "print('ok')"}, "probe.py", stdin="", isolate=True)
    if result.error is not None:
        return result.error
    if not result.ok or result.stdout.strip() != "ok":
        return f"a trivial isolated program failed (exit {result.exit_code}): {result.stderr.strip()[-500:]}"
    return None
