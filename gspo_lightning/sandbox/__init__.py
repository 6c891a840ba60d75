"""A sandbox for untrusted programs: its own namespaces, a minimal read-only root, per-run caps, no network."""

from gspo_lightning.sandbox.containment import ISOLATIONS, Isolation, SandboxUnavailableError
from gspo_lightning.sandbox.sandbox import Sandbox, SandboxResult, isolation_unavailable_reason
from gspo_lightning.sandbox.spec import SandboxLimits

__all__ = [
    "ISOLATIONS",
    "Isolation",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailableError",
    "isolation_unavailable_reason",
]
