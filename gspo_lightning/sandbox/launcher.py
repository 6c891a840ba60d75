"""The sandbox launcher: a small standard-library-only program that starts one untrusted program, contained.

It is started by :class:`gspo_lightning.sandbox.Sandbox` as ``python -I -S launcher.py '<json spec>'`` in a new
session, so nothing of the trainer's process (threads, CUDA, open files) is inherited. It never imports the
package: what runs between ``fork`` and ``exec`` must be simple and single-threaded.

With ``isolate`` set it enters new network, mount, PID and IPC namespaces (plus a user namespace when not root):

- network: a namespace with only a loopback interface that is down, so no socket reaches anything;
- mount: every mount is made read-only except the working directory, the trainer's base Python is bind-mounted
  read-only at ``<workdir>/.python`` (so a program that dropped privileges can still run it), and a fresh
  ``/proc`` shows only the sandbox's own processes (no ``/proc/<trainer>/environ``);
- PID: the program is PID 1 of its namespace; when it, or this launcher, dies the kernel kills every process in
  the namespace, so a fork bomb or a daemonised child cannot outlive the run.

If any of that fails the launcher exits with :data:`ISOLATION_FAILED` before running anything (fail closed).
Then, in the program's process: resource limits (CPU time, address space, file size, open files, processes,
no core dumps), ``no_new_privs``, and, when the launcher runs as root, a switch to an unprivileged uid/gid.
The launcher's exit status is the program's (``128 + signal`` when it was killed by a signal).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import sys

ISOLATION_FAILED = 125
"""Exit status when the namespaces could not be set up; nothing was run."""
SETUP_FAILED = 126
"""Exit status when the program's limits or credentials could not be applied; nothing was run."""

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWIPC = 0x00020000, 0x10000000, 0x08000000
_CLONE_NEWPID, _CLONE_NEWNET = 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38

_libc = ctypes.CDLL(None, use_errno=True)


class _SetupError(Exception):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        raise _SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int) -> int:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    return _libc.mount(encode(source), encode(target), encode(fstype), flags, None)


def _enter_namespaces() -> None:
    """New user (if not root), mount, PID, network and IPC namespaces for this process and its children."""
    uid, gid = os.getuid(), os.getgid()
    flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC
    if uid != 0:  # an unprivileged user may create namespaces only inside a user namespace of its own
        flags |= _CLONE_NEWUSER
    _check(_libc.unshare(flags), "unshare")
    if uid != 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as handle:
        points = {line.split()[4].replace("\\040", " ") for line in handle}
    return sorted(points, key=len)


def _seal_filesystem(workdir: str, python_prefix: str) -> None:
    """Everything read-only but ``workdir``; the base Python reachable read-only inside ``workdir``."""
    _check(_mount(None, "/", None, _MS_REC | _MS_PRIVATE), "make mounts private")
    _check(_mount(workdir, workdir, None, _MS_BIND), "bind the working directory")
    _check(_mount(python_prefix, os.path.join(workdir, ".python"), None, _MS_BIND | _MS_REC), "bind the base Python")
    for point in _mount_points():
        if point == workdir:
            continue
        if _mount(None, point, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY) != 0:
            # /proc is replaced by a fresh mount in the program's PID namespace; /sys is root-only for writes.
            if not point.startswith(("/proc", "/sys")):
                raise _SetupError(f"could not make {point} read-only: {os.strerror(ctypes.get_errno())}")


def _apply_limits(limits: dict) -> None:
    cpu = int(limits["cpu_time_s"])
    memory = int(limits["memory_mb"]) * 2**20
    file_size = int(limits["file_size_mb"]) * 2**20
    for name, soft, hard in (
        ("RLIMIT_CPU", cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard one
        ("RLIMIT_AS", memory, memory),
        ("RLIMIT_FSIZE", file_size, file_size),
        ("RLIMIT_NOFILE", int(limits["open_files"]), int(limits["open_files"])),
        ("RLIMIT_NPROC", int(limits["processes"]), int(limits["processes"])),
        ("RLIMIT_CORE", 0, 0),
    ):
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def _launcher_is_gone(alive_pipe: int) -> bool:
    """True when the launcher has exited: its end of the pipe is closed, so ours reads as end-of-file."""
    readable, _, _ = select.select([alive_pipe], [], [], 0)
    return bool(readable)


def _run_program(spec: dict, alive_pipe: int) -> None:
    """In the child: die with the launcher, limit, drop privileges, exec. Never returns."""
    try:
        _check(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent-death signal")
        # The launcher may have died before the death signal was armed; then nobody would kill us.
        if _launcher_is_gone(alive_pipe):
            os._exit(SETUP_FAILED)
        os.close(alive_pipe)
        if spec["isolate"]:
            _check(_mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC), "mount /proc")
        _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        os.chdir(spec["workdir"])
        _apply_limits(spec["limits"])
        if spec.get("run_as") is not None:
            _drop_privileges(*spec["run_as"])
    except (OSError, ValueError, _SetupError) as error:
        os.write(2, f"sandbox setup failed: {error}\n".encode())
        os._exit(SETUP_FAILED)
    argv = spec["argv"]
    try:
        os.execve(argv[0], argv, spec["env"])
    except OSError as error:
        os.write(2, f"sandbox could not start {argv[0]}: {error}\n".encode())
        os._exit(SETUP_FAILED)


def main() -> int:
    spec = json.loads(sys.argv[1])
    if spec["isolate"]:
        try:
            _enter_namespaces()
            _seal_filesystem(spec["workdir"], spec["python_prefix"])
        except (OSError, _SetupError) as error:
            sys.stderr.write(f"sandbox isolation failed: {error}\n")
            return ISOLATION_FAILED
    alive_read, alive_write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(alive_write)
        _run_program(spec, alive_read)
    os.close(alive_read)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main())
