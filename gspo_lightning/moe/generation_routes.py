"""The experts a mixture-of-experts policy chose during ``generate``, placed on the sequences' tokens (R3's record
for the ``hf`` engine).

``generate`` runs one forward over the prompts (the prefill; with a shared prefill, a forward over the P prompts
but their last column, then one over that column for the P x G rows), then one forward per new token over the
token sampled last. Each router sees a forward's [B x T] tokens flattened; a pre-hook on the input embedding tells
the [B, T] of each forward, so forward i's experts fill the next T columns of every row (a forward over P rows
serves each of its G responses). The last sampled token is read by no forward: its entries stay ``NOT_RECORDED``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from gspo_lightning.moe.routing import NOT_RECORDED, find_routers


class GenerationRoutes:
    """Filled by the forwards inside :func:`recording_generation_routes`; :meth:`placed` lays them out."""

    def __init__(self, layers: int, num_experts: int) -> None:
        self.shapes: list[tuple[int, int]] = []  # [B, T] of each forward
        self.layers: list[list[Tensor]] = [[] for _ in range(layers)]  # per layer, [B * T, k] per forward
        self.dtype = torch.int16 if num_experts < 2**15 else torch.int32
        self.result: Tensor | None = None  # [N, layers, Lp + R, k] once ``generate`` returned (``finish``)

    def finish(self, rows: int, width: int, skip_columns: int = 0) -> None:
        """Lay the forwards out over ``generate``'s [rows, width] sequences, without their first ``skip_columns``
        (a padding column added for the shared prefill), into ``result``."""
        self.result = self.placed(rows, width)[:, :, skip_columns:]

    def placed(self, rows: int, width: int) -> Tensor:
        """[rows, layers, width, k]: forward i's experts in the columns after forward i - 1's, ``NOT_RECORDED``
        where no forward read a token. Forwards past ``width`` (a rank that finished keeps stepping under
        ``synced_gpus``) are left out."""
        if any(len(per_layer) != len(self.shapes) for per_layer in self.layers):
            counts = sorted({len(per_layer) for per_layer in self.layers})
            raise RuntimeError(f"{len(self.shapes)} forwards of the policy but {counts} forwards of its routers")
        k = self.layers[0][0].shape[-1]
        out = torch.full((rows, len(self.layers), width, k), NOT_RECORDED, dtype=self.dtype)
        column = 0
        for forward, (batch, tokens) in enumerate(self.shapes):
            if column >= width:
                break
            if rows % batch:
                raise RuntimeError(f"a forward over {batch} rows cannot serve {rows} sequences")
            take = min(tokens, width - column)
            for layer, per_layer in enumerate(self.layers):
                experts = per_layer[forward].view(batch, tokens, k)[:, :take]  # [B, take, k]
                out[:, layer, column : column + take] = experts.repeat_interleave(rows // batch, dim=0).cpu()
            column += tokens
        return out


@contextmanager
def recording_generation_routes(policy: nn.Module) -> Iterator[GenerationRoutes]:
    """Record each router's experts for every forward inside the block (``generate``'s)."""
    routers = find_routers(policy)
    if not routers:
        name = type(policy).__name__
        raise ValueError(f"recording routed experts needs a mixture-of-experts policy; {name} has no router")
    record = GenerationRoutes(len(routers), max(router.num_experts for router in routers))
    layer_of = {id(router): layer for layer, router in enumerate(routers)}

    def shape(module: nn.Module, args: tuple) -> None:
        record.shapes.append(tuple(args[0].shape))  # [B, T] input ids

    def experts(module: nn.Module, inputs, output) -> None:
        record.layers[layer_of[id(module)]].append(output[2].detach().to(record.dtype))  # [B * T, k]

    handles = [policy.get_input_embeddings().register_forward_pre_hook(shape)]
    handles += [router.register_forward_hook(experts) for router in routers]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()
