"""What the user wrote on the command line and in its ``-c`` configs, as settings named the way they were written
(``sampler.episodes.environment``, ``sampler.rewards[0]``), so that an error message can name a setting the way
the user knows it rather than as the parser nests it (``sampler.episodes.init_args.environment``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

CONFIG_FLAGS = ("-c", "--config")


def config_paths(args: Sequence[str]) -> list[str]:
    """The ``-c`` / ``--config`` values of ``args``, as written, in order."""
    paths = []
    for index, arg in enumerate(args):
        if arg in CONFIG_FLAGS and index + 1 < len(args):
            paths.append(args[index + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def as_written(path: str, args: Sequence[str]) -> str:
    """The config path of ``args`` that ``path`` (absolute, as the parser reports it) came from, else ``path``."""
    return next((given for given in config_paths(args) if os.path.abspath(given) == os.path.abspath(path)), path)


def written_settings(args: Sequence[str]) -> list[tuple[str, Any]]:
    """Every (setting, value) the ``-c`` configs and the ``--key=value`` flags of ``args`` hold, in the order they
    apply (a later one overrides an earlier), each nested value included under its own name: ``sampler.rewards``,
    ``sampler.rewards[0]``, ``sampler.rewards[0].class_path``, ..."""
    settings: list[tuple[str, Any]] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg in CONFIG_FLAGS or arg.startswith("--config="):
            path = args[index + 1] if arg in CONFIG_FLAGS and index + 1 < len(args) else arg.split("=", 1)[1]
            settings += _flattened("", _read_yaml(path))
            index += 2 if arg in CONFIG_FLAGS else 1
            continue
        if arg.startswith("--"):
            key, has_value, value = arg[2:].partition("=")
            if not has_value and index + 1 < len(args) and not args[index + 1].startswith("-"):
                value, index = args[index + 1], index + 1
            settings += _flattened(key, _parsed(value))
        index += 1
    return settings


def setting_holding(value: str, args: Sequence[str]) -> str | None:
    """The setting, as written, whose value is ``value`` or whose ``class_path`` is (the last one that applies)."""
    found = None
    for setting, held in written_settings(args):
        if held == value:
            found = setting.removesuffix(".class_path") if setting.endswith(".class_path") else setting
    return found


def _read_yaml(path: str) -> Any:
    try:
        return yaml.safe_load(Path(path).expanduser().read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None


def _parsed(value: str) -> Any:
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def _flattened(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
    if prefix:
        yield prefix, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flattened(f"{prefix}.{key}" if prefix else str(key), item)
    elif isinstance(value, list):
        for number, item in enumerate(value):
            yield from _flattened(f"{prefix}[{number}]", item)
