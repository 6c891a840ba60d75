"""The host folders of runs, and their removal: a non-isolated run's working folder, an isolated run's mount point.

Each run gets one fresh folder in the temporary folder (``$TMPDIR``, ``/tmp``), made by :func:`make_run_folder`
and removed as soon as the run is over: without isolation (``best_effort`` fallback, ``off``) the program works
in it; an isolated run's tmpfs is mounted on it in the run's own mount namespace, so on the host it stays empty
(the run's files vanish with that tmpfs). Nothing outlives the run, so a process killed between runs (a reward
worker closed with SIGKILL) leaves nothing. The trainer holds an exclusive ``flock`` on the folder for as long as
the run lasts: a folder whose lock nobody holds is one a killed process left in the middle of a run, and the
next process to make a run folder, or to exit, removes it (:func:`remove_abandoned`); the lock, not a pid, tells
them apart, so pid reuse, pid namespaces and forked children (which inherit the lock) never pull a folder from
under a live run.

Removal is :func:`remove_tree`: iterative (any depth), through directory descriptors only, never following a
symbolic link (each entry is unlinked or opened ``O_NOFOLLOW`` relative to its folder's descriptor), and bounded
in time. Sub-folders are not descended into but moved up into the top folder (``renameat`` between descriptors),
so at most two descriptors are open at once however deep the tree, and a folder the program made unreadable is
reopened through its own descriptor (``O_PATH`` + ``/proc/self/fd``), not by path.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import itertools
import os
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# what a still-running program could have done to an entry between two steps of the removal
_CHANGED_MEANWHILE = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.ELOOP, errno.ENOENT)


# "run": a non-isolated run's working folder; "root": the folder an isolated run's tmpfs is mounted on. Names
# that earlier versions never made (their folders held no lock): a sweep must not take one still in use.
_PREFIXES = {"run": "gspo-sandbox-run-", "root": "gspo-sandbox-mnt-"}
_SWEEP_S = 10.0  # at most this long removing abandoned folders at once; the rest waits for the next sweep
_sweep_lock = threading.Lock()
_swept: list[bool] = []  # not empty once this process has swept (and will sweep again at exit)


@dataclass
class RunFolder:
    """One run's host folder, held (an exclusive ``flock`` on ``lock``) until :meth:`remove` is called."""

    path: Path
    lock: int

    def remove(self, deadline: float) -> bool:
        """Remove the folder and all in it; False if ``deadline`` (monotonic) came first (a later sweep finishes)."""
        try:
            return remove_tree(self.path, deadline)
        finally:
            if self.lock >= 0:  # unlocked, not just closed: a forked child's copy of the descriptor holds no more
                fcntl.flock(self.lock, fcntl.LOCK_UN)
                os.close(self.lock)
                self.lock = -1


def make_run_folder(kind: str, program_uid: int | None = None) -> RunFolder:
    """A fresh folder for one run, ``kind`` ``run`` (``work/`` inside it is made, for the program's user, by the
    launcher) or ``root`` (an isolated run's mount point); held by this process until removed."""
    _sweep_once()
    while True:
        path = Path(tempfile.mkdtemp(prefix=_PREFIXES[kind]))
        try:
            lock = os.open(path, _FOLDER_FLAGS)
        except FileNotFoundError:  # a sweep took it for abandoned before we held it: make another
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(lock).st_nlink > 0:  # a sweep between mkdtemp and flock removed it: make another
                break
        except BlockingIOError:  # a sweep holds it, to remove it: make another
            pass
        os.close(lock)
    if program_uid is not None:  # the program's user may pass through (not list) it to reach work/
        path.chmod(0o711)
    return RunFolder(path, lock)


def _sweep_once() -> None:
    """What killed processes left, removed at this process's first run folder, and again when it exits."""
    with _sweep_lock:  # concurrent first runs wait for the one sweep
        if not _swept:
            _swept.append(True)
            remove_abandoned(time.monotonic() + _SWEEP_S)
            atexit.register(lambda: remove_abandoned(time.monotonic() + _SWEEP_S))


def remove_abandoned(deadline: float) -> None:
    """Remove the run folders in the temporary folder that no live process holds: the ones a process killed in
    the middle of a run left (SIGKILL runs no exit handler). Only real folders of this user, link-safe."""
    top = Path(tempfile.gettempdir())
    parent = os.open(top, _FOLDER_FLAGS)
    try:
        for name in os.listdir(parent):
            if name.startswith(tuple(_PREFIXES.values())) and time.monotonic() < deadline:
                try:
                    _remove_if_abandoned(parent, top, name, deadline)
                except OSError:  # held (BlockingIOError), gone meanwhile, not ours: not ours to remove now
                    pass
    finally:
        os.close(parent)


def _remove_if_abandoned(parent: int, top: Path, name: str, deadline: float) -> None:
    info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():  # a link, a file, another user's
        return
    lock = os.open(name, _FOLDER_FLAGS, dir_fd=parent)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while we remove it, so no run can claim it
        remove_tree(top / name, deadline)
    finally:
        os.close(lock)


def remove_tree(path: Path, deadline: float) -> bool:
    """Remove the folder ``path`` and everything in it; False if ``deadline`` (monotonic) came first."""
    parent = os.open(path.parent, _FOLDER_FLAGS)
    try:
        top = _open_folder(parent, path.name)
        try:
            done = _empty(top, deadline)
        finally:
            os.close(top)
        if done:
            os.rmdir(path.name, dir_fd=parent)
        return done
    finally:
        os.close(parent)


def _empty(top: int, deadline: float) -> bool:
    """Empty the folder open as ``top``: its files unlinked, its sub-folders flattened into it and removed."""
    names = (f".gspo-removing-{n}" for n in itertools.count())
    while True:
        entries = list(os.scandir(top))
        if not entries:
            return True
        for entry in entries:
            if time.monotonic() > deadline:
                return False
            if not entry.is_dir(follow_symlinks=False):
                _unlink(top, entry.name)
                continue
            try:
                folder = _open_folder(top, entry.name)
            except OSError as error:  # no longer a folder (swapped for a link): the next pass unlinks it
                if error.errno not in _CHANGED_MEANWHILE:
                    raise
                continue
            try:
                for inner in list(os.scandir(folder)):
                    if inner.is_dir(follow_symlinks=False):
                        _move_up(folder, inner.name, top, names)
                    else:
                        _unlink(folder, inner.name)
            finally:
                os.close(folder)
            try:
                os.rmdir(entry.name, dir_fd=top)
            except OSError as error:  # refilled or swapped meanwhile: the next pass takes it again
                if error.errno not in _CHANGED_MEANWHILE:
                    raise


def _unlink(folder: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except FileNotFoundError:
        pass


def _move_up(folder: int, name: str, top: int, names) -> None:
    for new_name in names:
        try:
            os.rename(name, new_name, src_dir_fd=folder, dst_dir_fd=top)
            return
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise


def _open_folder(parent: int, name: str) -> int:
    """Open the folder ``name`` of ``parent`` without following links, and make it ours to empty."""
    try:
        folder = os.open(name, _FOLDER_FLAGS, dir_fd=parent)
    except PermissionError:  # the program took its read bit: reopen this very inode, not whatever the name is now
        handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            if not stat.S_ISDIR(os.fstat(handle).st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a folder", name) from None
            os.chmod(f"/proc/self/fd/{handle}", stat.S_IRWXU)
            folder = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        finally:
            os.close(handle)
    try:
        os.fchmod(folder, stat.S_IRWXU)  # write and search bits, to unlink what is inside
    except PermissionError:
        pass
    return folder
