"""What the command line prints for a mistake in the configuration: one line naming the setting as it is written
(``sampler.group_size``, not the argument it is linked to), with the allowed values, a "did you mean" for a typo,
and where a setting that moved has gone.

jsonargparse reports a bad option as a usage text of ~90 lines, or, inside a ``class_path`` / ``init_args`` block,
as a report of every type it tried; :func:`describe_argument_error` reads the setting and the reason out of it.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Iterable

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


def describe_argument_error(message: str, groups: dict[str, type]) -> str:
    """One line for a jsonargparse parsing error ``message``; ``groups`` maps each top-level key to the class its
    settings go to (``sampler`` -> ``GroupSampler``), for "did you mean"."""
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
