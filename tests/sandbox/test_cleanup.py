"""Removing a non-isolated run's folder: it never leaves the folder, whatever links, modes or depth it holds.

Isolated runs leave nothing on the host (their files live in the run's tmpfs); these cover the fallback
(``best_effort`` without namespaces, ``off``), where :func:`remove_tree` cleans up after the run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from gspo_lightning.sandbox import hostdir
from gspo_lightning.sandbox.hostdir import remove_tree


def _tree_with_traps(work: Path, victims) -> None:
    (work / "d").mkdir(parents=True)
    (work / "d/last.ckpt").write_text("mine")
    (work / "ckpt_dir").symlink_to(victims.checkpoints)
    (work / "ckpt_file").symlink_to(victims.checkpoints / "last.ckpt")
    locked = work / "locked/inner"
    locked.mkdir(parents=True)
    (locked / "f").write_text("x")
    locked.chmod(0)
    (work / "locked").chmod(0o100)


def test_links_and_closed_folders_are_removed_and_nothing_they_point_to(tmp_path, victims):
    private = tmp_path / "private"
    _tree_with_traps(private / "work", victims)
    assert remove_tree(private, time.monotonic() + 10)
    assert not private.exists() and victims.changes() == {}


def test_a_folder_swapped_for_a_link_mid_removal_is_not_followed(tmp_path, victims, monkeypatch):
    """The race of the issue, made deterministic: right when ``last.ckpt`` is about to be unlinked, the program
    moves the folder holding it away and puts a link to the victims' checkpoints in its place."""
    private = tmp_path / "private"
    _tree_with_traps(private / "work", victims)
    real_unlink, swapped = hostdir._unlink, []

    def unlink_racing_the_program(folder: int, name: str) -> None:
        if name == "last.ckpt" and not swapped:
            where = Path(os.readlink(f"/proc/self/fd/{folder}"))  # wherever the removal has put it by now
            where.rename(where.with_name(where.name + "_moved"))
            where.symlink_to(victims.checkpoints)
            swapped.append(where)
        real_unlink(folder, name)

    monkeypatch.setattr(hostdir, "_unlink", unlink_racing_the_program)
    assert remove_tree(private, time.monotonic() + 10)
    assert swapped and not private.exists()
    assert victims.changes() == {}


def test_a_1500_deep_tree_is_removed_without_recursion(tmp_path):
    private = tmp_path / "private"
    folder = os.open(tmp_path, os.O_RDONLY)
    os.mkdir("private", dir_fd=folder)
    for _ in range(1500):  # by descriptor: the path would pass PATH_MAX
        inner = os.open("private" if _ == 0 else "d", os.O_RDONLY, dir_fd=folder)
        os.close(folder)
        os.mkdir("d", dir_fd=inner)
        folder = inner
    os.close(folder)
    assert remove_tree(private, time.monotonic() + 30)
    assert not private.exists()


def test_removal_stops_at_its_deadline(tmp_path):
    private = tmp_path / "private"
    private.mkdir()
    for index in range(2000):
        (private / f"f{index}").touch()
    assert not remove_tree(private, time.monotonic() - 1)
    assert private.exists()
    assert remove_tree(private, time.monotonic() + 30) and not private.exists()
