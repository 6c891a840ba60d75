"""The launcher's end of the trainer-launcher protocol: exit statuses, reading the spec, writing outcome records.

The trainer describes a run with the dataclasses of ``gspo_lightning/sandbox/spec.py`` and sends them as one
``marshal``-encoded dict (both ends run the same interpreter; the data never comes from the program). This
module, imported by the trainer too, needs nothing but ``marshal``: the launcher starts once per program, and
``dataclasses`` or ``json`` would add a third to its start-up time. The launcher reads the spec as nested
namespaces with the dataclasses' field names (``spec.limits.wall_time_s``).
"""

from __future__ import annotations

import io
import marshal
import os
from types import SimpleNamespace

ISOLATION_FAILED = 125
"""Init's exit status when the namespaces or the minimal root could not be set up; nothing was run."""
SETUP_FAILED = 126
"""The program's process's exit status when its limits, credentials or filter could not be applied."""


def _namespace(value):
    if isinstance(value, dict) and all(isinstance(key, str) and key.isidentifier() for key in value):
        return SimpleNamespace(**{key: _namespace(item) for key, item in value.items()})
    return value


def read_spec(descriptor: int) -> SimpleNamespace:
    """The run's spec, as sent by the trainer (``LaunchSpec.to_wire``); ``files`` and ``env`` stay dicts."""
    with os.fdopen(descriptor, "rb") as handle:
        raw = marshal.loads(handle.read())
    mappings = {name: raw.pop(name) for name in ("files", "env")}
    spec = _namespace(raw)
    vars(spec).update(mappings)
    return spec


def write_outcome(descriptor: int, **record) -> None:
    """Append one outcome record (``stage``, ``error``, ``exit_code``, ``timed_out``) to the status file."""
    os.write(descriptor, marshal.dumps(record))


def read_outcomes(data: bytes) -> list[dict]:
    """Every complete record in ``data``, in order."""
    stream, records = io.BytesIO(data), []
    while stream.tell() < len(data):
        try:
            records.append(marshal.load(stream))
        except (EOFError, ValueError, TypeError):
            break
    return records
