"""The working directory of a run that has no mount namespace (``best_effort`` fallback, ``off``), and its removal.

An isolated run's files live in its own tmpfs and vanish with it; nothing here is used then. Without
isolation the run gets a private folder on the host, removed after every process of the run is gone, by
:func:`remove_tree`: iterative (any depth), through directory descriptors only, never following a symbolic
link (each entry is unlinked or opened ``O_NOFOLLOW`` relative to its folder's descriptor), and bounded in time.
Sub-folders are not descended into but moved up into the top folder (``renameat`` between descriptors), so at
most two descriptors are open at once however deep the tree, and a folder the program made unreadable is
reopened through its own descriptor (``O_PATH`` + ``/proc/self/fd``), not by path.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
import tempfile
import time
from pathlib import Path

_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# what a still-running program could have done to an entry between two steps of the removal
_CHANGED_MEANWHILE = (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.ELOOP, errno.ENOENT)


def make_private_folder(program_uid: int | None) -> Path:
    """A fresh folder for one run; ``work/`` inside it is made, for the program's user, by the launcher."""
    private = Path(tempfile.mkdtemp(prefix="gspo-sandbox-"))
    if program_uid is not None:  # the program's user may pass through (not list) it to reach work/
        private.chmod(0o711)
    return private


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
