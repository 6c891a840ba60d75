"""A sandbox for untrusted programs: separate process, resource limits, no network, throw-away directory."""

from gspo_lightning.sandbox.sandbox import (
    ISOLATIONS,
    Isolation,
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
    isolation_unavailable_reason,
)

__all__ = [
    "ISOLATIONS",
    "Isolation",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailableError",
    "isolation_unavailable_reason",
]
