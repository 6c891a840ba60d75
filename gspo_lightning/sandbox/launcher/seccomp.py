"""A seccomp filter for the program: the system calls no honest program needs and an escape would.

Denied with EPERM: new namespaces (``unshare``, ``setns``, ``clone`` with a ``CLONE_NEW*`` flag: so no nested user
namespace, and no tmpfs in one whose memory nothing counts), every mount call, kernel keyrings (state that
would outlive the run under its uid), ``ptrace`` and reading other processes' memory, ``bpf``,
``userfaultfd``, ``perf_event_open``, io_uring, and host administration (modules, kexec, swap, reboot, syslog,
accounting, quotas, handles). ``clone3`` fails with ENOSYS, whose flags a filter cannot read: the C library
then falls back to ``clone``, which it can. Another architecture's system calls kill the process.

The filter is classic BPF over ``struct seccomp_data`` (``nr`` at offset 0, ``arch`` at 4, the arguments from
16), built here with ``struct`` and installed with ``prctl(PR_SET_SECCOMP)`` after ``no_new_privs``.
"""

from __future__ import annotations

import ctypes
import errno
import struct

import syscalls
from syscalls import ARCHITECTURE, CLONE_NEWTIME, NAMESPACE_FLAGS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, SetupError

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: the same arch value, other numbers
# name: (x86_64, aarch64), from the kernel's unistd headers
_DENIED = {
    "unshare": (272, 97), "setns": (308, 268),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "move_mount": (429, 429), "open_tree": (428, 428), "mount_setattr": (442, 442),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "bpf": (321, 280), "userfaultfd": (323, 282), "perf_event_open": (298, 241),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "open_by_handle_at": (304, 265),
    "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142), "syslog": (103, 116),
    "acct": (163, 89), "quotactl": (179, 60), "vhangup": (153, 58),
}  # fmt: skip
_CLONE, _CLONE3 = {"x86_64": 56, "aarch64": 220}, 435

_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_ARCH_OFFSET, _NR_OFFSET, _ARG0_OFFSET = 4, 0, 16


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def filter_program() -> list[bytes]:
    """The filter's instructions for this machine's architecture."""
    if ARCHITECTURE not in _AUDIT_ARCH:
        raise SetupError(f"seccomp: no filter for this architecture ({ARCHITECTURE}); known: {sorted(_AUDIT_ARCH)}")
    column = 0 if ARCHITECTURE == "x86_64" else 1
    program = [_op(_LD_W_ABS, _ARCH_OFFSET), _op(_JEQ, _AUDIT_ARCH[ARCHITECTURE], jt=1), _op(_RET, _RET_KILL_PROCESS)]
    program.append(_op(_LD_W_ABS, _NR_OFFSET))
    if ARCHITECTURE == "x86_64":
        program += [_op(_JGE, _X32_SYSCALL_BIT, jf=1), _op(_RET, _RET_ERRNO | errno.EPERM)]
    denied = sorted({numbers[column] for numbers in _DENIED.values()})
    checks = [_CLONE3, _CLONE[ARCHITECTURE], *denied]
    first = len(program)
    allow, clone_check = first + len(checks), first + len(checks) + 1
    deny, no_such_call = clone_check + 3, clone_check + 4
    targets = [no_such_call, clone_check, *[deny] * len(denied)]
    for index, (number, target) in enumerate(zip(checks, targets)):
        program.append(_op(_JEQ, number, jt=target - (first + index + 1)))
    program.append(_op(_RET, _RET_ALLOW))  # allow
    clone_namespaces = NAMESPACE_FLAGS & ~CLONE_NEWTIME  # CLONE_NEWTIME's bit is the exit signal in clone()
    program += [_op(_LD_W_ABS, _ARG0_OFFSET), _op(_JSET, clone_namespaces, jt=1), _op(_RET, _RET_ALLOW)]
    program += [_op(_RET, _RET_ERRNO | errno.EPERM), _op(_RET, _RET_ERRNO | errno.ENOSYS)]
    assert len(program) == no_such_call + 1 and max(t - first for t in targets) < 256
    return program


class _Program(ctypes.Structure):
    _fields_ = [("length", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_filter() -> None:
    """Apply the filter to this process and all it starts (needs ``no_new_privs`` or CAP_SYS_ADMIN)."""
    instructions = filter_program()
    buffer = ctypes.create_string_buffer(b"".join(instructions))
    program = _Program(len(instructions), ctypes.cast(buffer, ctypes.c_void_p))
    syscalls.prctl_pointer(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), "seccomp filter")
