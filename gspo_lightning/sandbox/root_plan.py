"""What of the host an isolated program sees: the base interpreter, its standard library and shared libraries.

Worked out once per trainer process: a probe run of the base interpreter imports every extension module of its
standard library and lists the shared libraries it then has mapped (``/proc/self/maps``). The plan binds, read-only
and at their host paths, the interpreter binary, the standard library, the folders of those libraries and the
loader's cache (``/etc/ld.so.cache``, library paths only); it recreates the symbolic links that the kernel and
the loader follow to reach them (``/lib -> usr/lib``, the ELF interpreter's path); and it hides every
``site-packages`` / ``dist-packages`` folder inside what is bound, so the program gets the standard library only.
Not bound: the trainer's virtual environment, the project, the data, ``/etc``, ``/home``, ``/proc``, ``/sys``.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import struct
import subprocess
import sys
import sysconfig

from gspo_lightning.sandbox.spec import RootPlan

_PROBE = r"""
import importlib, json, os, sys, sysconfig
dynload = os.path.join(sysconfig.get_path('platstdlib'), 'lib-dynload')
for name in sorted(os.listdir(dynload) if os.path.isdir(dynload) else []):
    module = name.split('.')[0]
    if not module.startswith(('_test', 'xx', '_ctypes_test')):
        try:
            importlib.import_module(module)
        except Exception:
            pass
with open('/proc/self/maps') as handle:
    mapped = sorted({line.split()[-1] for line in handle if '.so' in line.rsplit('/', 1)[-1]})
paths = sysconfig.get_paths()
print(json.dumps({'libraries': mapped, 'stdlib': [paths['stdlib'], paths['platstdlib']],
                  'site': [paths['purelib'], paths['platlib']]}))
"""
_LOADER_CACHE = "/etc/ld.so.cache"
_PACKAGE_FOLDERS = ("site-packages", "dist-packages")


def base_interpreter() -> str:
    """The real path of the interpreter the trainer's virtual environment (if any) was made from."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


@functools.lru_cache(maxsize=1)
def minimal_root_plan() -> RootPlan:
    """The plan for this machine and interpreter (probed once per process), without a mount point: each run
    gets a folder of its own, made and removed with the run (``hostdir.make_run_folder``), so nothing of this
    cached plan lives on the host."""
    interpreter = base_interpreter()
    completed = subprocess.run(
        [interpreter, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False
    )
    if completed.returncode != 0:
        raise RuntimeError(f"probing the base interpreter {interpreter} failed: {completed.stderr[-2000:]}")
    probe = json.loads(completed.stdout)
    library_folders = {os.path.dirname(os.path.realpath(path)) for path in probe["libraries"]}
    stdlib = {os.path.realpath(path) for path in probe["stdlib"]}
    loader_cache = {_LOADER_CACHE} if os.path.exists(_LOADER_CACHE) else set()
    binds = _outermost({interpreter, *stdlib, *library_folders, *loader_cache})
    symlinks = _symlinks_to(binds, elf_interpreter(interpreter))
    masks = _package_folders(binds, probe["site"])
    return RootPlan(
        mount_point="", binds=tuple(sorted(binds)), symlinks=tuple(symlinks), masks=tuple(sorted(masks))
    )


_PT_INTERP = 3
# Per ELF class (1: 32-bit, 2: 64-bit): the program-header table's offset (format, position in the header), the
# position of its entry size and count, and an entry's type, offset and size (the other fields skipped).
_ELF_LAYOUT = {1: ("I", 28, 42, "II8xI"), 2: ("Q", 32, 54, "I4xQ16xQ")}


def elf_interpreter(path: str) -> str | None:
    """The ELF program interpreter (dynamic loader) a binary names, or None (static, not ELF)."""
    with open(path, "rb") as handle:
        header = handle.read(64)
        if header[:4] != b"\x7fELF" or header[4] not in _ELF_LAYOUT:
            return None
        order = "<" if header[5] == 1 else ">"
        table_format, table_at, sizes_at, entry_format = _ELF_LAYOUT[header[4]]
        (table,) = struct.unpack_from(order + table_format, header, table_at)
        entry_size, count = struct.unpack_from(order + "HH", header, sizes_at)
        entry_format = order + entry_format
        for index in range(count):
            handle.seek(table + index * entry_size)
            kind, offset, size = struct.unpack(entry_format, handle.read(struct.calcsize(entry_format)))
            if kind == _PT_INTERP:
                handle.seek(offset)
                return handle.read(size).rstrip(b"\0").decode()
    return None


def symlinks_on_the_way(path: str, limit: int = 40) -> list[tuple[str, str]]:
    """Every symbolic link that resolving ``path`` goes through, as ``(link path, link text)``."""
    links: list[tuple[str, str]] = []
    pending = [part for part in path.split("/") if part]
    current = "/"
    while pending:
        candidate = os.path.join(current, pending.pop(0))
        if os.path.islink(candidate):
            if len(links) >= limit:
                raise RuntimeError(f"too many symbolic links resolving {path}")
            text = os.readlink(candidate)
            links.append((candidate, text))
            target = os.path.normpath(os.path.join(current, text))
            pending = [part for part in target.split("/") if part] + pending
            current = "/"
        else:
            current = candidate
    return links


def _symlinks_to(binds: set[str], loader: str | None) -> list[tuple[str, str]]:
    """Links the loader's paths go through, and top-level links (``/lib``) whose target holds a bound path."""
    links = symlinks_on_the_way(loader) if loader else []
    for name in sorted(os.listdir("/")):
        top = "/" + name
        if os.path.islink(top):
            target = os.path.realpath(top)
            if any(bound.startswith(target + "/") for bound in binds) and (top, os.readlink(top)) not in links:
                links.append((top, os.readlink(top)))
    return links


def _package_folders(binds: set[str], site: list[str]) -> set[str]:
    """Third-party package folders inside what is bound (``lib/python3.X/site-packages`` and the like)."""
    candidates = {os.path.realpath(path) for path in site}
    for bound in binds:
        if not os.path.isdir(bound):
            continue
        for level_one in _subfolders(bound):
            candidates |= {level_one} if os.path.basename(level_one) in _PACKAGE_FOLDERS else set()
            candidates |= {p for p in _subfolders(level_one) if os.path.basename(p) in _PACKAGE_FOLDERS}
    return {path for path in candidates if os.path.isdir(path) and any(_inside(path, b) for b in binds)}


def _subfolders(folder: str) -> list[str]:
    try:
        return [entry.path for entry in os.scandir(folder) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _outermost(paths: set[str]) -> set[str]:
    return {path for path in paths if not any(other != path and _inside(path, other) for other in paths)}


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/")


def unreachable_by_others() -> str | None:
    """Why a program under another, unprivileged uid could not run the base interpreter from the host's file
    system (outside a mount namespace), or None: every folder on the way must let others through, the
    interpreter and the standard library let them read."""
    stdlib = os.path.realpath(sysconfig.get_path("stdlib"))
    for path in (base_interpreter(), stdlib):
        folder = os.path.dirname(path)
        while folder != "/":
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return f"{folder} (on the way to {path}) is closed to other users"
            folder = os.path.dirname(folder)
        if not os.stat(path).st_mode & stat.S_IROTH:
            return f"{path} is not readable by other users"
    return None

