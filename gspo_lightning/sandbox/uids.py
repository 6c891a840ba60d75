"""Unprivileged uids for programs when the trainer runs as root, each held by one run at a time machine-wide.

A uid is leased by taking an exclusive ``flock`` on a file named after it in a root-only folder: the kernel
releases the lock when every descriptor of that open file is closed, so a lease ends with its holder, however
it dies. Locks taken through separate ``open`` calls conflict even inside one process, so two ``Sandbox``
instances (the rollout's and the evaluation's reward, a reward thread abandoned after a timeout) or two trainer
processes never get the same uid, and so never share a process limit, a keyring or a signal target. The
launcher of a run inherits the lease's descriptor, so the uid stays taken until the run's last process is gone,
even if the trainer dies first.
"""

from __future__ import annotations

import fcntl
import os
import random
import stat
from dataclasses import dataclass
from pathlib import Path

UID_FIRST = 1 << 20  # far above any real account
UID_COUNT = 1 << 16
_LOCK_FOLDERS = (Path("/run/gspo-sandbox-uids"), Path("/tmp/gspo-sandbox-uids-0"))


@dataclass
class UidLease:
    """One uid (used as the gid too), held while ``descriptor`` is open."""

    uid: int
    descriptor: int

    def release(self) -> None:
        if self.descriptor >= 0:
            os.close(self.descriptor)
            self.descriptor = -1


def _lock_folder() -> Path:
    """A folder only root can write, made if need be; refuses one that someone else could have planted."""
    problems = []
    for folder in _LOCK_FOLDERS:
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            info = folder.lstat()
        except OSError as error:
            problems.append(f"{folder}: {error.strerror}")
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and not info.st_mode & 0o022:
            return folder
        problems.append(f"{folder}: not a root-owned folder closed to others")
    raise RuntimeError(f"no folder for sandbox uid leases: {'; '.join(problems)}")


def lease_uid(attempts: int = 4096) -> UidLease:
    """A uid no other run on this machine holds."""
    folder = _lock_folder()
    start = random.randrange(UID_COUNT)
    for step in range(attempts):
        uid = UID_FIRST + (start + step) % UID_COUNT
        descriptor = os.open(folder / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            continue
        return UidLease(uid, descriptor)
    raise RuntimeError(f"no free sandbox uid after {attempts} tries in {folder}")
