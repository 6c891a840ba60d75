"""What the command line prints for a mistake in the configuration: one line naming the setting as it is written
(``sampler.group_size``, not the argument it is linked to), with the allowed values, a "did you mean" for a typo,
and where a setting that moved has gone.

jsonargparse reports a bad option as a usage text of ~90 lines, or, inside a ``class_path`` / ``init_args`` block,
as a report of every type it tried; :func:`describe_argument_error` reads the setting and the reason out of it.

When the user's own code raises (a reward function, a tool, an environment), :func:`user_code_report` leads with
one line naming the setting, the function and the error, followed by the frames of the user's code only.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
import re
import sysconfig
import traceback
from collections.abc import Iterable, Sequence
from pathlib import Path

from gspo_lightning.cli_sources import as_written, setting_holding
from gspo_lightning.validation import user_code_error

MOVED_SETTINGS = {
    "model.init_args.lr": "optimizer.init_args.lr (optimizer: {class_path: torch.optim.AdamW, init_args: {lr: ...}})",
    "model.init_args.weight_decay": "optimizer.init_args.weight_decay",
    "model.init_args.warmup_steps": (
        "lr_scheduler.init_args.warmup_steps "
        "(lr_scheduler: {class_path: gspo_lightning.schedules.LinearWarmup, init_args: {warmup_steps: ...}})"
    ),
    "sampler.share_prompt_prefill": (
        "sampler.engine.init_args.share_prompt_prefill "
        "(sampler: {engine: {class_path: gspo_lightning.engines.HFEngine, init_args: {share_prompt_prefill: ...}}})"
    ),
    "sampler.sampling_dtype": (
        "sampler.engine.init_args.sampling_dtype "
        "(sampler: {engine: {class_path: gspo_lightning.engines.HFEngine, init_args: {sampling_dtype: ...}}})"
    ),
    # One setting each for the samples and their log-probs, read by the sampler from the module.
    "sampler.temperature": "model.init_args.temperature (model: {init_args: {temperature: ...}})",
    "sampler.max_new_tokens": "model.init_args.max_new_tokens (model: {init_args: {max_new_tokens: ...}})",
}
"""Settings of earlier releases -> where they are now (CHANGELOG.md says how to update a config)."""

TOP_LEVEL_SETTINGS = ("seed_everything", "ckpt_path", "optimizer", "lr_scheduler", "config", "print_config")
"""Top-level keys besides the groups of classes."""
_UNION_ERROR = "Does not validate against any of the Union subtypes"
_EXPECTED = re.compile(r"Expected a <class '(\w+)'>\. Got value: (.*)")
_MISSING_CONFIG = re.compile(r"Parser key \"config\": File does not exist: '([^']+)'")
_NO_MODULE = re.compile(r"No module named '([^']+)'")
_NO_ATTRIBUTE = re.compile(r"module '([^']+)' has no attribute '([^']+)'")
_CLASS_PATHS = re.compile(
    r"class_path '([\w.]+)'|class_path='([\w.]+)'|Got value: ([\w]+(?:\.[\w]+)+)\s*$", re.MULTILINE
)


def one_line(error: Exception) -> str:
    """The message that names the setting: jsonargparse wraps a class's own error in a many-line report of
    every union member it tried (the class and None); the class's error is the line worth reading."""
    message = str(error)
    if _UNION_ERROR in message:
        reasons = [line.strip()[2:] for line in message.splitlines() if line.strip().startswith("- ")]
        reasons = [reason for reason in reasons if not reason.startswith("Expected a <class 'NoneType'>")]
        if reasons:
            return "; ".join(reasons)
    return message.strip().splitlines()[0] if message.strip() else type(error).__name__


def describe_argument_error(message: str, groups: dict[str, type], args: Sequence[str] = ()) -> str:
    """One line for a jsonargparse parsing error ``message``; ``groups`` maps each top-level key to the class its
    settings go to (``sampler`` -> ``GroupSampler``), for "did you mean"; ``args``, the command line, to name a
    config file or a setting as the user wrote it."""
    missing = _MISSING_CONFIG.search(message)
    if missing:
        return f"config file '{as_written(missing[1], args)}' does not exist"
    failed_import = import_failure(message, args)
    if failed_import is not None:
        return failed_import
    unknown = _unknown_setting(message)
    if unknown is not None:
        setting, owner = unknown
        if "." not in setting:
            return unknown_setting_line(setting, None, sorted({*groups, *TOP_LEVEL_SETTINGS}))
        return unknown_setting_line(setting, owner if owner is not None else groups.get(setting.split(".")[0]))
    keys = re.findall(r'Parser key "([^"]+)"', message)
    if keys:
        reasons = [line.strip()[2:] for line in message.splitlines() if line.strip().startswith("- ")]
        reasons = [r for r in reasons if not r.startswith(("Expected a <class 'NoneType'>", "Problem with given"))]
        detail = "; ".join(reasons) or _after_key(message)
        return f"{_nested_key(keys)}: {_EXPECTED.sub(lambda m: f'expected {m[1]}, got {m[2]!r}', detail)}"
    return message.strip().splitlines()[0] if message.strip() else "invalid arguments"


def unknown_setting_line(setting: str, owner: type | None, accepted: list[str] | None = None) -> str:
    """``setting`` does not exist: where it moved, or the closest of the settings ``owner`` accepts (or of
    ``accepted``)."""
    moved = MOVED_SETTINGS.get(setting)
    if moved is not None:
        return f"{setting} has moved: set {moved} instead (see CHANGELOG.md)"
    name = setting.rsplit(".", 1)[-1]
    if accepted is None:
        accepted = sorted(init_parameters(owner)) if owner is not None else []
    close = difflib.get_close_matches(name, accepted, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    where = f" ({owner.__module__}.{owner.__qualname__})" if owner is not None else ""
    listed = f"; accepted: {', '.join(accepted)}" if accepted and not close else ""
    return f"unknown setting {setting}{where}{hint}{listed}"


def init_parameters(cls: type) -> set[str]:
    """The keyword arguments ``cls(...)`` accepts, those its ``**kwargs`` pass to its bases included."""
    names: set[str] = set()
    for klass in inspect.getmro(cls):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameters = inspect.signature(init).parameters.values()
        names |= {p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return names


def _unknown_setting(message: str) -> tuple[str, type | None] | None:
    """(the setting as written, the class that lacks it, if the message names one), or None."""
    group = re.search(r"Group '([^']+)' does not accept option '([^']+)'", message)
    if group:
        return f"{group[1]}.{group[2]}", None
    subcommand = re.search(r"Subcommand '[^']+' does not accept option '([^']+)'", message)  # a key in a YAML file
    if subcommand:
        return subcommand[1], None
    unrecognized = re.search(r"unrecognized arguments: (\S+)", message)
    if unrecognized:
        return unrecognized[1].lstrip("-").split("=", 1)[0], None
    option = re.search(r"Option '([^']+)' is not accepted", message)
    if option:
        keys = re.findall(r'Parser key "([^"]+)"', message)
        classes = re.findall(r"Problem with given class_path '([^']+)'", message)
        owner = _import(classes[-1]) if classes else None
        prefix = _nested_key(keys) if keys else ""
        return (f"{prefix}.init_args.{option[1]}" if classes else f"{prefix}.{option[1]}").lstrip("."), owner
    return None


def _nested_key(keys: Iterable[str]) -> str:
    """``Parser key`` names of nested class_path blocks joined as the config writes them."""
    return ".init_args.".join(keys)


def _after_key(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip() and not line.strip().startswith("Parser key")]
    return lines[0] if lines else "invalid value"


def _import(path: str) -> type | None:
    module, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if inspect.isclass(found) else None


def import_failure(message: str, args: Sequence[str] = ()) -> str | None:
    """One line for a ``class_path`` (or function path) the parser could not import: the setting as written in
    ``args``, the path, why, and the closest names the module does have; None when ``message`` is about
    something else."""
    no_module, no_attribute = _NO_MODULE.search(message), _NO_ATTRIBUTE.search(message)
    if no_module is None and no_attribute is None:
        return None
    paths = [next(group for group in match if group) for match in _CLASS_PATHS.findall(message)]
    if no_attribute is not None:
        module, name = no_attribute[1], no_attribute[2]
        path = next((p for p in reversed(paths) if p.startswith(f"{module}.{name}")), f"{module}.{name}")
        why = f"module {module} has no attribute {name}{_did_you_mean(module, name)}"
    else:
        module = no_module[1]
        path = next((p for p in reversed(paths) if p == module or p.startswith(f"{module}.")), None)
        if path is None:  # the module was found, and failed importing a dependency of its own
            path = paths[-1] if paths else module
            why = f"importing it failed: No module named '{module}' (install it)"
        else:
            why = f"no module named {module}{_module_hint(module)}"
    setting = setting_holding(path, args) or _parser_setting(message)
    return f"{setting}: cannot import {path}: {why}"


def _did_you_mean(module: str, name: str) -> str:
    """"; did you mean module.X?" among the module's public names and its submodules, or ""."""
    try:
        found = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    names = {n for n in dir(found) if not n.startswith("_")}
    names |= {info.name for info in pkgutil.iter_modules(getattr(found, "__path__", []))}
    close = difflib.get_close_matches(name, sorted(names), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(f'{module}.{c}' for c in close)}?" if close else ""


def _module_hint(module: str) -> str:
    parent, _, name = module.rpartition(".")
    if parent:
        return _did_you_mean(parent, name) or f" (module {parent} has no submodule {name})"
    return " (not installed, and not on PYTHONPATH: run from the folder that holds it, or pip install it)"


def _parser_setting(message: str) -> str:
    keys = re.findall(r'Parser key "([^"]+)"', message)
    return _nested_key(keys) if keys else "class_path"


LIBRARY_FOLDERS: tuple[str, ...] = (
    str(Path(__file__).resolve().parent),  # gspo_lightning
    *{str(Path(sysconfig.get_paths()[name]).resolve()) for name in ("stdlib", "platstdlib")},
)
"""Where the frames a user's traceback leaves out live, besides any ``site-packages`` (Lightning, torch, ...)."""
_REMOTE_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>.+)\n(?:    (?P<code>.+)\n)?',
                           re.MULTILINE)  # fmt: skip
_TRACEBACK_HINT = "GSPO_LIGHTNING_TRACEBACK=1 shows the whole traceback"


def user_code_report(
    raised: BaseException, full: bool = False, rank: int = 0, library: Sequence[str] = LIBRARY_FOLDERS
) -> str | None:
    """What the command line prints when the user's code raised ``raised`` (or the error it wraps, see
    ``validation.user_code_error``): ``error: <setting> (<function>) raised <Error>: <message>``, what it was
    called on, then the frames of files outside ``library`` and ``site-packages`` (``full``: every frame of
    ``raised``); one line on a rank other than 0. None when ``raised`` is not about the user's code."""
    error = user_code_error(raised)
    if error is None:
        return None
    if rank != 0:
        return f"error: (rank {rank}) {error.headline()}"
    lines = [f"error: {error.headline()}", *([f"  {error.detail}"] if error.detail else [])]
    if full:
        return "\n".join([*lines, "".join(traceback.format_exception(raised)).rstrip("\n")])
    frames = [frame for frame in error_frames(error.error) if is_user_file(frame.filename, library)]
    if not frames:
        return "\n".join([*lines, f"(no frame of your code in its traceback; {_TRACEBACK_HINT})"])
    shown = "".join(traceback.StackSummary.from_list(frames).format())
    last = "".join(traceback.format_exception_only(type(error.error), error.error))
    return "\n".join([*lines, f"Traceback of your code ({_TRACEBACK_HINT}):", shown + last.rstrip("\n")])


def error_frames(error: BaseException) -> list[traceback.FrameSummary]:
    """The frames ``error`` was raised through, those of a worker process first (``concurrent.futures`` sends
    them as text, in the ``__cause__``)."""
    remote = getattr(error.__cause__, "tb", None)
    frames = []
    if isinstance(remote, str):
        frames = [traceback.FrameSummary(m["file"], int(m["line"]), m["name"], line=m["code"] or "")
                  for m in _REMOTE_FRAME.finditer(remote)]  # fmt: skip
    return frames + list(traceback.extract_tb(error.__traceback__))


def is_user_file(filename: str, library: Sequence[str] = LIBRARY_FOLDERS) -> bool:
    """A file of the user's own code: a real file, outside ``library`` and outside any installed package."""
    if filename.startswith("<"):  # <frozen runpy>, <string>
        return False
    path = Path(filename).resolve()
    if {"site-packages", "dist-packages"} & set(path.parts):
        return False
    return not any(path.is_relative_to(folder) for folder in library)
