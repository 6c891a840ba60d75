"""The last steps in the program's own process, from the most to the least privileged, then ``exec``.

1. join the run's cgroups (memory and process caps over every process the program will start);
2. resource limits: CPU seconds, file size (stdout and stderr included), open files, processes (per uid, or
   per user namespace), no core dumps; and, only where there is no cgroup, the address space per process;
3. ``no_new_privs`` and an empty capability bounding set: no set-uid binary or file capability gives anything;
4. when the trainer is root: the run's own unprivileged uid and gid, no supplementary groups (this also
   empties the capability sets); in a user namespace the program keeps a uid that is not 0 there, so ``exec``
   leaves it no capability;
5. the seccomp filter (``seccomp.py``);
6. ``exec`` of the interpreter, with a scrubbed environment.

If a step fails, the error goes to the launcher's status channel and the process exits with ``SETUP_FAILED``
before anything of the program ran.
"""

from __future__ import annotations

import os
import resource
import signal
from types import SimpleNamespace

import seccomp
import syscalls
from syscalls import PR_SET_NO_NEW_PRIVS
from wire import SETUP_FAILED, write_outcome

_DEFAULT_SIGNALS = (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD)


def exec_program(spec: SimpleNamespace, cgroup_procs: list[int], status: int) -> None:
    """Contain this process and replace it by the program. Never returns."""
    try:
        for descriptor in cgroup_procs:
            os.write(descriptor, b"0")  # "0": the writing process, whatever PID namespace it is in
            os.close(descriptor)
        for number in _DEFAULT_SIGNALS:  # the launcher is Python: it ignores some signals the program should not
            signal.signal(number, signal.SIG_DFL)
        _apply_limits(spec)
        syscalls.prctl(PR_SET_NO_NEW_PRIVS, 1, "no_new_privs")
        if spec.isolate or spec.run_as is not None:
            syscalls.drop_capability_bounding_set()
        if spec.run_as is not None:
            uid, gid = spec.run_as
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        if not spec.isolate:
            os.chdir(spec.workdir)
        if spec.seccomp:
            seccomp.install_filter()
    except Exception as error:  # noqa: BLE001 - whatever it is, nothing of the program may run
        _fail(status, f"sandbox setup failed: {type(error).__name__}: {error}")
    try:
        os.execve(spec.argv[0], spec.argv, spec.env)
    except OSError as error:
        _fail(status, f"sandbox could not start {spec.argv[0]}: {error}")


def _fail(status: int, message: str) -> None:
    write_outcome(status, stage="setup", error=message)
    os._exit(SETUP_FAILED)


def _apply_limits(spec: SimpleNamespace) -> None:
    limits = spec.limits
    cpu = limits.cpu_time_s
    file_size = limits.file_size_mb * 2**20
    rlimits = [
        ("RLIMIT_CPU", cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard one
        ("RLIMIT_FSIZE", file_size, file_size),
        ("RLIMIT_NOFILE", limits.open_files, limits.open_files),
        ("RLIMIT_NPROC", limits.processes, limits.processes),
        ("RLIMIT_CORE", 0, 0),
    ]
    if not spec.cgroup_procs:  # the fallback bound; a cgroup counts real memory, not reserved address space
        memory = limits.memory_mb * 2**20
        rlimits.append(("RLIMIT_AS", memory, memory))
    for name, soft, hard in rlimits:
        resource.setrlimit(getattr(resource, name), (soft, hard))
