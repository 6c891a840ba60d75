"""Where a run's logs and checkpoints live, and what ``--ckpt_path`` resumes.

A run writes into its logger's folder, ``<save_dir>/<name>/version_<n>/``, and its checkpoints into
``checkpoints/`` below that (``ModelCheckpoint``'s default). Lightning's own ``--ckpt_path last`` looks in the
folder of the *new* run, which a fresh ``version_<n+1>`` has empty: it warns and trains from step 0. Here
``--ckpt_path last`` means the newest ``version_<n>`` of the configured run that holds a ``last.ckpt``, and a
resumed run (``last`` or a path inside such a folder) logs into that same ``version_<n>``, so its history stays
in one place. Asked to resume with nothing to resume from, the run stops with an error instead.

A run that fails before it has written anything of value (a setting refused at fit start, a data error, Ctrl-C
during the warm start) leaves no empty ``version_<n>`` behind: the command line notes the folder before the fit
creates it (:func:`new_run_folder`) and removes it again when the run fails and the folder holds nothing but its
``config.yaml`` (:func:`holds_nothing_of_value`). A folder that existed before the run (a resumed run's) is never
removed.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from gspo_lightning.validation import SettingError

LAST = "last.ckpt"
_VERSION = re.compile(r"version_(\d+)$")
_VERSIONED_LOGGERS = ("CSVLogger", "TensorBoardLogger", "RunCSVLogger")
"""Logger classes with the ``<save_dir>/<name>/version_<n>`` layout and a ``version`` setting."""
_CONTINUABLE_LOGGERS = ("TensorBoardLogger", "RunCSVLogger")
"""Those that continue a folder's logs; Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` instead, so a
run resumed under it logs into a new ``version_<n>``."""


def resolve_resume(config: Any) -> str | None:
    """Resolve ``config.ckpt_path`` (a ``fit`` subcommand's parsed config, changed in place): ``last`` becomes the
    newest ``last.ckpt`` of the configured run, and the logger's ``version`` the folder the checkpoint is in.
    Returns the checkpoint path, or None when the run does not resume."""
    requested = config.get("ckpt_path")
    if requested in (None, "best", "hpc", "registry"):  # Lightning's other names, resolved by Lightning
        return None
    logger = _versioned_logger(config.trainer)
    root = _run_root(config.trainer, logger)
    if requested == "last":
        path = _last_checkpoint(config.trainer, root)
    else:
        path = Path(requested).expanduser()
        if not path.exists():
            raise SettingError(f"--ckpt_path={requested}: no such checkpoint (a file, or a sharded checkpoint folder)")
    version = _version_of(path, root)
    init_args = getattr(logger, "init_args", None) if _class_name(logger) in _CONTINUABLE_LOGGERS else None
    if version is not None and init_args is not None and getattr(init_args, "version", None) is None:
        init_args.version = version  # log into the resumed run's folder, not a new version_<n+1>
    config.ckpt_path = str(path)
    return config.ckpt_path


def _last_checkpoint(trainer: Any, root: Path) -> Path:
    """The newest ``last.ckpt`` of the run: in the checkpoint callback's own ``dirpath`` when one is set, else in
    the highest ``version_<n>`` under ``root`` that has one."""
    dirpath = _checkpoint_dirpath(trainer)
    candidates = [Path(dirpath) / LAST] if dirpath else _versions_with_last(root)
    found = [path for path in candidates if path.exists()]
    if not found:
        where = Path(dirpath) / LAST if dirpath else root / "version_*" / "checkpoints" / LAST
        raise SettingError(
            f"--ckpt_path last: no checkpoint to resume ({where} does not exist): leave out --ckpt_path to start "
            "a new run, or give --ckpt_path=<path to a .ckpt>"
        )
    return found[-1]


def _versions_with_last(root: Path) -> list[Path]:
    versions = [(int(match[1]), child) for child in _children(root) if (match := _VERSION.match(child.name))]
    return [folder / "checkpoints" / LAST for _, folder in sorted(versions)]


def _children(root: Path) -> list[Path]:
    return [child for child in root.iterdir() if child.is_dir()] if root.is_dir() else []


def _version_of(path: Path, root: Path) -> int | None:
    """``n`` when ``path`` lies in ``root/version_<n>/``, else None."""
    try:
        relative = path.resolve().relative_to(root.resolve())
    except ValueError:
        return None
    match = _VERSION.match(relative.parts[0]) if relative.parts else None
    return int(match[1]) if match else None


def _versioned_logger(trainer: Any) -> Any:
    """The trainer's logger config when it is one logger with the versioned folder layout, else None."""
    logger = trainer.get("logger")
    if isinstance(logger, list) and logger:
        logger = logger[0]  # the first logger's folder is the run's (Lightning's trainer.log_dir)
    return logger if _class_name(logger) in _VERSIONED_LOGGERS else None


def _class_name(entry: Any) -> str:
    return str(getattr(entry, "class_path", "")).rsplit(".", 1)[-1]


def _run_root(trainer: Any, logger: Any) -> Path:
    """``<save_dir>/<name>`` of the logger, or Lightning's default ``<default_root_dir>/lightning_logs``."""
    if logger is None:
        return Path(trainer.get("default_root_dir") or ".") / "lightning_logs"
    init_args = logger.init_args
    name = getattr(init_args, "name", "lightning_logs")
    return Path(getattr(init_args, "save_dir", ".")) / (name or "")


def _checkpoint_dirpath(trainer: Any) -> str | None:
    for callback in trainer.get("callbacks") or []:
        if str(getattr(callback, "class_path", "")).endswith("ModelCheckpoint"):
            return getattr(callback.init_args, "dirpath", None)
    return None


SETUP_FILES = ("config.yaml", "hparams.yaml")
"""What a run writes into its folder before it has trained or logged anything."""
_LOG_FILES = {".csv": 1, ".jsonl": 0}
"""Log files by suffix, and how many lines one holds before its first record (a CSV's header)."""


def holds_nothing_of_value(folder: str | Path) -> bool:
    """True when every file under ``folder`` is a setup file (``config.yaml``, ``hparams.yaml``) or a log file
    with no record yet: no checkpoint, no metrics, no completions, nothing a user would miss."""
    for path in Path(folder).rglob("*"):
        if path.is_dir() or path.name in SETUP_FILES:
            continue
        header = _LOG_FILES.get(path.suffix)
        if header is None or len([line for line in path.read_bytes().splitlines() if line.strip()]) > header:
            return False
    return True


def new_run_folder(trainer: Any) -> Path | None:
    """The outermost folder the fit will create for the trainer's first logger (``version_<n>``, or ``runs/<name>``
    or ``runs`` when those do not exist yet), on rank 0 (the rank that writes it); None when the run's folder
    exists already (a resumed run's) or on other ranks. Read before the fit starts: the logger creates it then."""
    loggers = getattr(trainer, "loggers", None) or []
    if not loggers or getattr(trainer, "global_rank", 0) != 0 or not getattr(loggers[0], "log_dir", None):
        return None
    folder = Path(loggers[0].log_dir).absolute()
    if folder.exists():
        return None
    while not folder.parent.exists():
        folder = folder.parent
    return folder


def remove_if_nothing_of_value(folder: Path | None) -> bool:
    """Remove ``folder`` (what :func:`new_run_folder` found this run would create) when it holds nothing of value;
    True when removed."""
    if folder is None or not folder.is_dir() or not holds_nothing_of_value(folder):
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True
