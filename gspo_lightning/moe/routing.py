"""Routing Replay for Hugging Face mixture-of-experts models, and how much routing moves between policies.

GSPO section 4.3: after a gradient update, a noticeable share of the experts an MoE model activates for the same
tokens changes (the paper: ~10% at 48 layers), so token-level importance ratios compare probabilities produced
by different sub-networks. Routing Replay records the experts pi_old activated per token and forces the same
experts in pi_theta's forward on the same tokens. The router still learns: the forced experts' weights are
pi_theta's router probabilities at those experts (renormalised as the model does), so their gradient flows to
the router.

Works with routers in the transformers >= 5 convention: a module whose forward returns
``(router_logits [T, E], top_k_weights [T, k], top_k_index [T, k])`` and that has ``top_k`` and
``num_experts``, with softmax-then-top-k routing (optionally renormalised, ``norm_topk_prob``): Qwen2-MoE,
Qwen3-MoE, Mixtral, OLMoE and similar. Everything here is pure tensor code or a scoped forward hook.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers in forward order (one per MoE layer); empty for a dense model."""
    return [
        module
        for module in model.modules()
        if type(module).__name__.endswith("Router") and hasattr(module, "top_k") and hasattr(module, "num_experts")
    ]


def replayed_weights(router_logits: Tensor, top_k_index: Tensor, normalize: bool) -> Tensor:
    """The routing weights of the forced experts under the current router: softmax probabilities (float32)
    gathered at ``top_k_index`` and, like the model, renormalised to sum to 1 when ``normalize``.

    Args:
        router_logits: [T, E] current router logits (differentiable).
        top_k_index: [T, k] the experts to use (pi_old's choice).
        normalize: the model's ``norm_topk_prob``.

    Returns:
        [T, k] weights in ``router_logits``' dtype; gradient flows to the logits.
    """
    probabilities = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights = probabilities.gather(-1, top_k_index.long())  # [T, k]
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(router_logits.dtype)


def expert_change_fraction(old_index: Tensor, new_index: Tensor, token_mask: Tensor) -> Tensor:
    """Per layer, the fraction of activated (token, expert) pairs of the new routing absent from the old one.

    Args:
        old_index: [n, layers, L, k] experts pi_old activated per token.
        new_index: [n, layers, L, k] experts the current router would activate.
        token_mask: [n, L] 1 on real tokens (padding is routed too but does not count).

    Returns:
        [layers] float32 fractions in [0, 1] (0 where there is no real token).
    """
    matches = (new_index.unsqueeze(-1) == old_index.unsqueeze(-2)).any(-1)  # [n, layers, L, k]
    changed = (~matches).float().sum(-1)  # [n, layers, L] experts replaced per token
    mask = token_mask.float().unsqueeze(1)  # [n, 1, L]
    per_layer = (changed * mask).sum((0, 2))  # [layers]
    activated = mask.sum((0, 2)) * old_index.shape[-1]  # [1] -> pairs per layer
    return per_layer / activated.clamp(min=1)


class _RouteCapture:
    """Collects each router's top-k index during one forward (as [n, L, k] per router)."""

    def __init__(self, batch_shape: tuple[int, int]) -> None:
        self.batch_shape = batch_shape
        self.indices: list[Tensor] = []

    def stacked(self, layers: int | None = None) -> Tensor:
        """[n, layers, L, k] int16 (int32 when experts do not fit), from the first forward's ``layers`` routers
        (a checkpointed backward re-runs the forward and records them again)."""
        return torch.stack(self.indices[:layers], dim=1)


def _as_routes(index: Tensor, batch_shape: tuple[int, int], num_experts: int) -> Tensor:
    dtype = torch.int16 if num_experts < 2**15 else torch.int32
    return index.detach().reshape(*batch_shape, index.shape[-1]).to(dtype)  # [n, L, k]


@contextmanager
def capture_routes(model: nn.Module, batch_shape: tuple[int, int]) -> Iterator[_RouteCapture]:
    """Record the experts every router selects during the forwards inside the block.

    Args:
        model: the policy.
        batch_shape: (n, L) of the forward's input ids, to give each token its place.

    Yields an object whose ``stacked()`` is [n, layers, L, k] after one forward.
    """
    capture = _RouteCapture(batch_shape)

    def record(module: nn.Module, inputs, output):
        capture.indices.append(_as_routes(output[2], batch_shape, module.num_experts))

    handles = [router.register_forward_hook(record) for router in find_routers(model)]
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def replay_routes(model: nn.Module, routes: Tensor) -> Iterator[_RouteCapture]:
    """Force the experts in ``routes`` (pi_old's) in every router during one forward inside the block.

    Args:
        model: the policy.
        routes: [n, layers, L, k] recorded by :func:`capture_routes` on the same input ids.

    Yields a capture of the experts the routers would have chosen by themselves (for diagnostics).
    """
    routers = find_routers(model)
    if routes.shape[1] != len(routers):
        raise ValueError(f"routes hold {routes.shape[1]} layers but the model has {len(routers)} routers")
    n, _, length, _ = routes.shape
    capture = _RouteCapture((n, length))
    layer_of = {id(router): layer for layer, router in enumerate(routers)}

    def force(module: nn.Module, inputs, output):
        router_logits, _, natural_index = output
        capture.indices.append(_as_routes(natural_index, (n, length), module.num_experts))
        forced = routes[:, layer_of[id(module)]].reshape(-1, routes.shape[-1]).to(natural_index.device)  # [T, k]
        weights = replayed_weights(router_logits, forced, bool(getattr(module, "norm_topk_prob", False)))
        return router_logits, weights, forced.to(natural_index.dtype)

    handles = [router.register_forward_hook(force) for router in routers]
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()
