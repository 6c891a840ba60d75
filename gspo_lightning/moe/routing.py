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
from typing import Literal

import torch
from torch import Tensor, nn

from gspo_lightning.validation import SettingError, require_one_of


RoutingReplay = Literal["off", "old", "rollout"]
ROUTING_REPLAYS: tuple[str, ...] = ("off", "old", "rollout")


def routing_replay_mode(value: str | bool) -> str:
    """``model.routing_replay`` as one of ``ROUTING_REPLAYS``. YAML reads an unquoted ``off`` as false, which means
    ``off``; ``true`` was Routing Replay before it had a choice, and is refused naming what it became."""
    if value is False:
        return "off"
    if value is True:
        raise SettingError(
            "model.routing_replay: true is now model.routing_replay: old (replay the experts of the trainer's pi_old "
            "forward, R2); model.routing_replay: rollout replays the sampler's experts (R3)"
        )
    require_one_of("model.routing_replay", value, ROUTING_REPLAYS)
    return value


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
    """Each router's top-k experts per token of the minibatch ([n * L, k] per layer), filled by the forwards inside
    a ``capture_routes`` or ``replay_routes`` block.

    A forward's tokens need not be the minibatch's [n, L] rectangle: packed rows and micro-batches run other
    layouts. Before each such forward, :func:`announce_places` says where its tokens sit in the minibatch
    (``places``: [T] flat indices into [n * L], -1 for a packed row's padding tail); the places stay until the
    next announcement, so a checkpointed layer's recomputation in backward reads those of its own forward (autograd
    finishes one micro-batch's backward, whose checkpointed forward announces again, before the next one's).
    Recording is a scatter into fixed places: a recomputed forward writes the same experts again.
    """

    def __init__(self, batch_shape: tuple[int, int], layers: int) -> None:
        self.batch_shape = batch_shape
        self.places: Tensor | None = None  # [T]; None: the forward runs the minibatch's [n, L] itself
        self.indices: list[Tensor | None] = [None] * layers  # [n * L, k] per layer, once recorded

    def stacked(self) -> Tensor:
        """[n, layers, L, k] int16 (int32 when experts do not fit); 0 where no forward had a token."""
        n, length = self.batch_shape
        return torch.stack([index.view(n, length, -1) for index in self.indices], dim=1)

    def forward_places(self, tokens: int) -> Tensor:
        """[T] where the running forward's tokens sit in the minibatch's [n * L]."""
        if self.places is None:
            n, length = self.batch_shape
            if tokens != n * length:
                raise RuntimeError(f"a forward of {tokens} tokens over an {n} x {length} minibatch announced no places")
            return torch.arange(tokens)
        return self.places

    def record(self, layer: int, index: Tensor, num_experts: int) -> None:
        """Experts ``index`` [T, k] chosen by router ``layer`` for the running forward's tokens."""
        places = self.forward_places(index.shape[0]).to(index.device)  # [T]
        if self.indices[layer] is None:
            dtype = torch.int16 if num_experts < 2**15 else torch.int32
            size = self.batch_shape[0] * self.batch_shape[1]
            self.indices[layer] = torch.zeros(size, index.shape[-1], dtype=dtype, device=index.device)
        real = places >= 0  # [T]
        self.indices[layer][places[real]] = index.detach()[real].to(self.indices[layer].dtype)


NOT_RECORDED = -1
"""A route entry no forward recorded (a token the sampler never read, padding): replay lets the router choose."""

_ACTIVE: list[_RouteCapture] = []  # the captures and replays whose blocks are open


def routes_active() -> bool:
    """Whether a capture or replay block is open (the forwards must announce their places)."""
    return bool(_ACTIVE)


def announce_places(places: Tensor | None) -> None:
    """The next forwards' tokens sit at ``places`` ([T] into the minibatch's flat [n * L], -1 for none) for every
    open capture and replay; None: they are the minibatch's [n, L] itself."""
    for capture in _ACTIVE:
        capture.places = places


@contextmanager
def _hooked(routers: list[nn.Module], capture: _RouteCapture, hook) -> Iterator[_RouteCapture]:
    handles = [router.register_forward_hook(hook) for router in routers]
    _ACTIVE.append(capture)
    try:
        yield capture
    finally:
        _ACTIVE.remove(capture)
        for handle in handles:
            handle.remove()


@contextmanager
def capture_routes(model: nn.Module, batch_shape: tuple[int, int]) -> Iterator[_RouteCapture]:
    """Record the experts every router selects during the forwards inside the block.

    Args:
        model: the policy.
        batch_shape: (n, L) of the minibatch's input ids, to give each token its place.

    Yields an object whose ``stacked()`` is [n, layers, L, k] after the forwards.
    """
    routers = find_routers(model)
    capture = _RouteCapture(batch_shape, len(routers))
    layer_of = {id(router): layer for layer, router in enumerate(routers)}

    def record(module: nn.Module, inputs, output):
        capture.record(layer_of[id(module)], output[2], module.num_experts)

    with _hooked(routers, capture, record):
        yield capture


@contextmanager
def replay_routes(model: nn.Module, routes: Tensor) -> Iterator[_RouteCapture]:
    """Force the experts in ``routes`` (pi_old's) in every router during the forwards inside the block.

    Args:
        model: the policy.
        routes: [n, layers, L, k] recorded by :func:`capture_routes` on the same minibatch, or by the sampling
            engine (Rollout Routing Replay); ``NOT_RECORDED`` (-1) where the router is to choose by itself.

    Yields a capture of the experts the routers would have chosen by themselves (for diagnostics).
    """
    routers = find_routers(model)
    if routes.shape[1] != len(routers):
        raise ValueError(f"routes hold {routes.shape[1]} layers but the model has {len(routers)} routers")
    n, _, length, k = routes.shape
    capture = _RouteCapture((n, length), len(routers))
    layer_of = {id(router): layer for layer, router in enumerate(routers)}

    def force(module: nn.Module, inputs, output):
        router_logits, _, natural_index = output
        layer = layer_of[id(module)]
        capture.record(layer, natural_index, module.num_experts)
        places = capture.forward_places(natural_index.shape[0]).to(natural_index.device)  # [T]
        recorded = routes[:, layer].reshape(-1, k).to(natural_index.device)  # [n * L, k]
        spare = torch.arange(k, device=natural_index.device).expand(len(places), k)  # [T, k] a row's padding tail
        forced = torch.where((places >= 0)[:, None], recorded[places.clamp(min=0)].long(), spare)  # [T, k]
        # NOT_RECORDED places (a token no sampling forward read: a response's last) keep the router's own choice
        forced = torch.where(forced >= 0, forced, natural_index.long())  # [T, k]
        weights = replayed_weights(router_logits, forced, bool(getattr(module, "norm_topk_prob", False)))
        return router_logits, weights, forced.to(natural_index.dtype)

    with _hooked(routers, capture, force):
        yield capture
