"""The sandbox launcher: starts one untrusted program, contained, and makes sure nothing of it outlives the run.

Run by :class:`gspo_lightning.sandbox.Sandbox` as ``python -I -S <this folder> <spec fd> <status fd>``, with the
program's stdin, stdout and stderr as descriptors 0-2 (memory files the trainer reads afterwards). Standard
library only, never the package: it must be small, start fast and run under the base interpreter.

Three processes, each with one job::

    launcher (host PID namespace)        waits at most wall_time_s, then SIGKILLs init; reports the outcome
      └─ init (PID 1 of a new namespace)  builds the minimal root (rootfs.py), starts the program, reaps
           └─ program                      contains itself (program.py), then exec

When init exits, for whatever reason (the program ended, the launcher killed it at the wall-clock limit, the
launcher died and init's parent-death signal fired), the kernel kills every process left in the PID
namespace and init is only reaped once they are all gone: the launcher's ``waitpid`` returning means nothing of
the run is left, whatever process groups, sessions or signal handlers the program set up. Init's
parent-death signal is set after its last credential change, and the program, running under another uid
(or, in a user namespace, without capabilities), can neither signal nor trace it.

With ``isolate`` the launcher first enters new user (when not root), PID, network, IPC and UTS namespaces; a
user namespace maps the trainer's uid to itself, so the program is not root there. Without it (``best_effort``
fallback, ``off``), init is not PID 1: the launcher kills init's process group, and, when the program runs as
its own uid, every process of that uid; the trainer's cgroup, when it has one, catches the rest.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from types import SimpleNamespace

from program import exec_program
from rootfs import enter_minimal_root, write_program_files
from syscalls import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    CLONE_NEWUTS,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_DUMPABLE,
    PR_SET_PDEATHSIG,
    SetupError,
    prctl,
    unshare,
)
from wire import ISOLATION_FAILED, SETUP_FAILED, read_spec, write_outcome


def _enter_namespaces() -> None:
    """New PID, network (no interface up: no connection goes anywhere), IPC and UTS namespaces for the
    launcher's children; and a user namespace first when not root, which an unprivileged user needs for them."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    unshare(flags | (CLONE_NEWUSER if uid != 0 else 0), "unshare(user, PID, network, IPC, UTS namespaces)")
    if uid != 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)


def _init(spec: SimpleNamespace, alive: int, cgroup_procs: list[int], status: int) -> None:
    """PID 1 of the run: die with the launcher, build the root, start the program, reap. Never returns."""
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "parent-death signal")
        if _launcher_is_gone(alive):  # it died before the signal was armed: nobody would kill us
            os._exit(ISOLATION_FAILED)
        prctl(PR_SET_DUMPABLE, 0, "not dumpable")  # no ptrace, no /proc peeking at init, even by its uid
        if spec.isolate:
            enter_minimal_root(spec)
        else:
            os.setsid()  # the launcher kills this group when the run ends
    except (OSError, SetupError) as error:
        write_outcome(status, stage="isolation", error=f"sandbox isolation failed: {error}")
        os._exit(ISOLATION_FAILED)
    program = os.fork()
    if program == 0:
        try:
            os.close(alive)
            exec_program(spec, cgroup_procs, status)
        finally:  # a forked child never returns into init's code
            os._exit(SETUP_FAILED)
    for descriptor in (alive, *cgroup_procs, status):
        os.close(descriptor)
    while True:
        try:
            pid, wait_status = os.wait()
        except ChildProcessError:
            os._exit(1)
        if pid == program:
            os._exit(_exit_code(wait_status))


def _launcher_is_gone(alive: int) -> bool:
    import select

    readable, _, _ = select.select([alive], [], [], 0)  # our end reads as end-of-file once the writer is gone
    return bool(readable)


def _exit_code(wait_status: int) -> int:
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def _wait(init: int, wall_time_s: float) -> tuple[int, bool]:
    """Init's wait status and whether the wall-clock limit was reached (init is then killed)."""
    deadline = time.monotonic() + wall_time_s
    while True:
        pid, wait_status = os.waitpid(init, os.WNOHANG)
        if pid == init:
            return wait_status, False
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            os.kill(init, signal.SIGKILL)  # init is our unreaped child: this pid cannot be anyone else
            return os.waitpid(init, 0)[1], True
        signal.sigtimedwait([signal.SIGCHLD], min(remaining, 1.0))


def _kill_leftovers(spec: SimpleNamespace, init: int) -> None:
    """Without a PID namespace: init's process group, every process in the run's cgroups, every process of the
    program's own uid; then reap them (this launcher is their subreaper), so none lingers as a zombie."""
    deadline = time.monotonic() + 2.0
    try:
        os.killpg(init, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for procs in spec.cgroup_procs:
        while time.monotonic() < deadline:
            with open(procs) as handle:
                members = [int(pid) for pid in handle.read().split()]
            if not members:
                break
            for pid in members:
                _kill_quietly(pid)
    if spec.run_as is not None:
        killer = os.fork()
        if killer == 0:  # as that uid, kill(-1) reaches exactly its processes (and not this one)
            os.setgroups([])
            os.setresgid(spec.run_as[1], spec.run_as[1], spec.run_as[1])
            os.setresuid(spec.run_as[0], spec.run_as[0], spec.run_as[0])
            for _ in range(3):
                _kill_quietly(-1)
            os._exit(0)
        os.waitpid(killer, 0)
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.005)
        except ChildProcessError:
            return


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main() -> int:
    spec_fd, status, *held = map(int, sys.argv[1:])
    spec = read_spec(spec_fd)
    for descriptor in (status, *held):  # kept open by this process and init, closed in the program at exec
        os.set_inheritable(descriptor, False)
    try:
        if spec.isolate:
            _enter_namespaces()
        else:
            prctl(PR_SET_CHILD_SUBREAPER, 1, "child subreaper")  # the run's orphans come to us, not to PID 1
            write_program_files(spec.workdir, spec)
        cgroup_procs = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in spec.cgroup_procs]
    except (OSError, SetupError) as error:
        write_outcome(status, stage="isolation", error=f"sandbox isolation failed: {error}")
        return ISOLATION_FAILED
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # for sigtimedwait; init unblocks it for the program
    alive, alive_writer = os.pipe()
    init = os.fork()
    if init == 0:
        try:
            os.close(alive_writer)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            _init(spec, alive, cgroup_procs, status)
        finally:  # a forked child never returns into the launcher's code
            os._exit(ISOLATION_FAILED)
    os.close(alive)
    for descriptor in cgroup_procs:
        os.close(descriptor)
    wait_status, timed_out = _wait(init, spec.limits.wall_time_s)
    if not spec.isolate:
        _kill_leftovers(spec, init)
    write_outcome(status, exit_code=_exit_code(wait_status), timed_out=timed_out)
    return 0


if __name__ == "__main__":
    os._exit(main())  # nothing to flush or finalise: skip the interpreter's shutdown
