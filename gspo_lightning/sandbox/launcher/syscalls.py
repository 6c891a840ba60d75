"""The few Linux system calls the launcher needs that Python's ``os`` lacks, through ``ctypes`` on libc.

Every wrapper raises :class:`SetupError` naming what failed, so the launcher can report it and run nothing.
"""

from __future__ import annotations

import ctypes
import errno
import os

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWTIME = 0x10000000, 0x20000000, 0x40000000, 0x00000080
NAMESPACE_FLAGS = (
    CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
    | CLONE_NEWTIME
)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 22, 36, 38
SECCOMP_MODE_FILTER = 2

_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
ARCHITECTURE = os.uname().machine

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class SetupError(Exception):
    """A containment step failed; the message says which and why."""


def check(result: int, what: str) -> None:
    if result != 0:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def unshare(flags: int, what: str) -> None:
    check(_libc.unshare(flags), what)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    result = _libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data))
    check(result, f"mount {fstype or source or ''} on {target}")


def umount_detached(target: str) -> None:
    check(_libc.umount2(target.encode(), MNT_DETACH), f"detach {target}")


def pivot_root_here() -> None:
    """Make the current directory the root; the old root is stacked on it, for the caller to detach."""
    number = _PIVOT_ROOT.get(ARCHITECTURE)
    if number is None:
        raise SetupError(f"pivot_root: no system-call number known for this architecture ({ARCHITECTURE})")
    check(_libc.syscall(number, b".", b"."), "pivot_root")


def prctl(option: int, argument: int, what: str) -> None:
    check(_libc.prctl(option, ctypes.c_ulong(argument), 0, 0, 0), what)


def prctl_pointer(option: int, argument: int, pointer: ctypes._Pointer, what: str) -> None:
    check(_libc.prctl(option, ctypes.c_ulong(argument), pointer, 0, 0), what)


def drop_capability_bounding_set() -> None:
    """No capability can come back, not even through a set-uid or file-capability binary."""
    for capability in range(64):  # past the kernel's last capability the call fails with EINVAL
        if _libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            raise SetupError(f"drop capability {capability}: {os.strerror(ctypes.get_errno())}")
