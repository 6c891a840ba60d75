"""The minimal root of an isolated run, built in its own mount namespace by the run's init process.

The root is a fresh tmpfs capped at the run's disk bytes and file count (``size=``, ``nr_inodes=``), mounted on
an empty host folder; into it go, read-only, the host paths the plan names (the interpreter, its standard
library, its shared libraries' folders, with third-party packages masked), a few device nodes, a private
``/tmp`` and ``/dev/shm``, a two-line ``/etc/passwd``, and the working directory with the program's files.
Then it becomes ``/`` (``pivot_root``) and the host's tree is detached: nothing else of the host is reachable,
by path or by socket file. The tmpfs lives as long as the namespace, so when the run's last process is gone its
files are gone too, without anyone walking them.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from syscalls import (
    CLONE_NEWNS,
    MS_BIND,
    MS_NOATIME,
    MS_NODEV,
    MS_NODIRATIME,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_RELATIME,
    MS_REMOUNT,
    SetupError,
    mount,
    pivot_root_here,
    umount_detached,
    unshare,
)

_SKELETON_INODES = 64  # the root's own folders, links, mount points and files, besides the program's

# statvfs flags -> mount flags: a remount must keep what the source mount has (the kernel locks them in a user
# namespace) besides what we add.
_KEPT_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)


def enter_minimal_root(spec: SimpleNamespace) -> None:
    """Build the run's root from ``spec.root`` (a ``LaunchSpec`` as sent) and make it ``/``; cwd: the workdir."""
    plan = spec.root
    if plan is None or not plan.mount_point:
        raise SetupError("isolated run without a root plan or a mount point")
    unshare(CLONE_NEWNS, "unshare(mount namespace)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates back to the host
    new_root = plan.mount_point
    input_bytes = sum(len(text.encode()) for text in spec.files.values())
    size = spec.limits.disk_mb * 2**20 + input_bytes + 2**20
    inodes = spec.limits.max_files + len(spec.files) + _SKELETON_INODES + len(plan.binds) + len(plan.symlinks)
    options = f"size={size},nr_inodes={inodes},mode=0755"
    mount("gspo-sandbox", new_root, "tmpfs", MS_NOSUID | MS_NODEV, options)
    _populate(new_root, plan, spec)
    _cap_what_is_left(new_root, spec)
    os.chdir(new_root)
    pivot_root_here()
    umount_detached(".")  # the host's tree, stacked on "/" by pivot_root
    os.chdir(spec.workdir)


def _cap_what_is_left(new_root: str, spec: SimpleNamespace) -> None:
    """Shrink the tmpfs to exactly ``disk_mb`` and ``max_files`` beyond what the root itself holds now."""
    usage = os.statvfs(new_root)
    used_bytes = (usage.f_blocks - usage.f_bfree) * usage.f_frsize
    used_inodes = usage.f_files - usage.f_ffree
    size, inodes = used_bytes + spec.limits.disk_mb * 2**20, used_inodes + spec.limits.max_files
    mount(None, new_root, None, MS_REMOUNT | MS_NOSUID | MS_NODEV, f"size={size},nr_inodes={inodes}")


def _populate(new_root: str, plan: SimpleNamespace, spec: SimpleNamespace) -> None:
    for path, text in plan.symlinks:
        _make_parents(new_root, path)
        if not os.path.lexists(new_root + path):
            os.symlink(text, new_root + path)
    for path in plan.binds:
        _bind_read_only(path, new_root + path, device=False)
    for path in plan.masks:
        mount("gspo-sandbox-mask", new_root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k")
    for path in plan.devices:
        _bind_read_only(path, new_root + path, device=True)
    for path, mode in (("/tmp", 0o1777), ("/dev/shm", 0o1777), ("/etc", 0o755)):
        os.makedirs(new_root + path, exist_ok=True)
        os.chmod(new_root + path, mode)
    uid, gid = spec.run_as or (os.getuid(), os.getgid())
    accounts = f"root:x:0:0::/:/nonexistent\nsandbox:x:{uid}:{gid}::{spec.workdir}:/nonexistent\n"
    _write(new_root + "/etc/passwd", accounts)
    _write(new_root + "/etc/group", f"root:x:0:\nsandbox:x:{gid}:\n")
    write_program_files(new_root + spec.workdir, spec)


def write_program_files(workdir: str, spec: SimpleNamespace) -> None:
    """The working directory, private to the program's user, with the program's files in it."""
    uid, gid = spec.run_as or (os.getuid(), os.getgid())
    os.makedirs(workdir, mode=0o700, exist_ok=True)
    for name, text in spec.files.items():
        parts = name.split("/")
        if name.startswith("/") or any(part in ("", ".", "..") for part in parts):
            raise SetupError(f"sandbox file name {name!r} leaves the working directory")
        for depth in range(1, len(parts)):
            folder = os.path.join(workdir, *parts[:depth])
            if not os.path.isdir(folder):
                os.mkdir(folder, 0o700)
                os.chown(folder, uid, gid)
        _write(os.path.join(workdir, name), text, owner=(uid, gid))
    os.chown(workdir, uid, gid)


def _write(path: str, text: str, owner: tuple[int, int] | None = None) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600 if owner else 0o644)
    try:
        os.write(descriptor, text.encode())
        if owner is not None:
            os.fchown(descriptor, *owner)
    finally:
        os.close(descriptor)


def _make_parents(new_root: str, path: str) -> None:
    os.makedirs(os.path.dirname(new_root + path), mode=0o755, exist_ok=True)


def _bind_read_only(source: str, target: str, device: bool) -> None:
    """Bind ``source`` (not what is mounted below it) at ``target``, read-only, no set-uid, no new devices."""
    _make_parents("", target)
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    elif not os.path.exists(target):
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
    mount(source, target, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | (0 if device else MS_NODEV)
    kept = os.statvfs(target).f_flag
    for statvfs_flag, mount_flag in _KEPT_FLAGS:
        if kept & statvfs_flag:
            flags |= mount_flag
    if device:
        flags |= MS_NOEXEC
    mount(None, target, None, flags)
