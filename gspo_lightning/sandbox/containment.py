"""Which containment steps this machine provides, and what a sandbox does when one is missing (fail closed).

Steps, each probed once per trainer process:

- ``namespaces``: new user (when not root), PID, network, IPC, UTS and mount namespaces and the minimal root
  built in them (no host file, socket or process visible; nothing outlives the run's PID namespace);
- ``seccomp``: the system-call filter (no nested namespaces, mounts, keyrings, ptrace ...);
- ``cgroup``: a per-run cgroup capping the memory and process count of the whole run;
- ``uids``: when the trainer is root, an unprivileged uid per concurrent run, unique machine-wide;
- ``shared_interpreter``: other users can run the base interpreter from the host's file system (needed for a
  per-run uid without namespaces, where nothing is bound in).

``isolation: required`` needs ``namespaces`` and ``seccomp`` (and ``uids`` as root) and refuses to run without
them; a missing ``cgroup`` has a documented fallback (``memory_mb`` per process x ``processes``) and is only
warned about. ``best_effort`` runs with whatever is there and warns, naming each missing step and what stands
in for it. ``off`` uses no namespace, filter or uid of its own: trusted code only.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

Isolation = Literal["required", "best_effort", "off"]
ISOLATIONS: tuple[str, ...] = ("required", "best_effort", "off")

_FALLBACKS = {
    "namespaces": "the program runs in a private folder on the host with the limits only: it can read what its "
    "user can read, and descendants that leave its process group survive unless the cgroup or its own uid "
    "catches them",
    "seccomp": "nested user namespaces, mounts (where privileged), keyrings and ptrace stay open to the program",
    "cgroup": "memory is capped per process (RLIMIT_AS = memory_mb), so a run may use up to memory_mb x "
    "processes, plus its disk; the process count is capped per uid (RLIMIT_NPROC)",
    "uids": "the program runs as the trainer's user",
    "shared_interpreter": "without namespaces the program runs as the trainer's user (root), with the limits only",
}
_NAMES = {
    "namespaces": "network/mount/PID namespaces and the minimal root",
    "seccomp": "the system-call filter (seccomp)",
    "cgroup": "a per-run memory and process cgroup",
    "uids": "per-run unprivileged uids",
    "shared_interpreter": "an interpreter other users can run",
}


class SandboxUnavailableError(RuntimeError):
    """Isolation was required, and this machine cannot provide it."""


@dataclass(frozen=True)
class Containment:
    """What this machine provides: each step is None when available, else why not."""

    namespaces: str | None
    seccomp: str | None
    cgroup: str | None
    uids: str | None
    shared_interpreter: str | None = None

    def missing(self) -> dict[str, str]:
        return {step: reason for step, reason in vars(self).items() if reason is not None}


@dataclass(frozen=True)
class RunMode:
    """What every run of one sandbox uses."""

    isolate: bool
    seccomp: bool
    cgroup: bool
    own_uids: bool


def describe_missing(missing: dict[str, str]) -> str:
    return "; ".join(f"{_NAMES[step]} ({reason}): {_FALLBACKS[step]}" for step, reason in missing.items())


def decide(isolation: Isolation, containment: Containment, is_root: bool) -> RunMode:
    """The run mode for ``isolation`` on this machine; raises or warns as the module docstring says."""
    missing = containment.missing()
    if not is_root:
        missing.pop("uids", None)
    if not is_root or "namespaces" not in missing:  # only a root trainer's fallback needs it
        missing.pop("shared_interpreter", None)
    if isolation == "off":
        return RunMode(isolate=False, seccomp=False, cgroup="cgroup" not in missing, own_uids=False)
    required_missing = {step: missing[step] for step in ("namespaces", "seccomp", "uids") if step in missing}
    if isolation == "required" and required_missing:
        raise SandboxUnavailableError(
            "sandbox isolation='required' but this machine cannot provide "
            + "; ".join(f"{_NAMES[step]}: {reason}" for step, reason in required_missing.items())
            + ". Run as root or allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1 / "
            "user.max_user_namespaces > 0), or set isolation: best_effort if the programs are trusted"
        )
    if missing:
        mode = "required" if isolation == "required" else "best_effort"
        warnings.warn(f"sandbox (isolation='{mode}') runs without {describe_missing(missing)}", stacklevel=3)
    return RunMode(
        isolate="namespaces" not in missing,
        seccomp="seccomp" not in missing,
        cgroup="cgroup" not in missing,
        own_uids=is_root and "uids" not in missing and "shared_interpreter" not in missing,
    )
