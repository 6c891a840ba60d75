"""Mixture-of-experts support: Routing Replay and routing-change diagnostics for Hugging Face MoE policies."""

from gspo_lightning.moe.routing import (
    capture_routes,
    expert_change_fraction,
    find_routers,
    replay_routes,
    replayed_weights,
)

__all__ = ["capture_routes", "expert_change_fraction", "find_routers", "replay_routes", "replayed_weights"]
