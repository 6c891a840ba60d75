"""Routed experts from vLLM (Rollout Routing Replay with the vLLM engines): vLLM's layout into the engines'.

Built with ``enable_return_routed_experts``, vLLM reports each completion's experts
(``CompletionOutput.routed_experts``; a server's ``routed_experts``, a base64 ``.npy``): [T - 1, decoder layers, k]
unsigned integers over the request's T prompt and response tokens, all but the last sampled one (no forward read
it), with a row for every decoder layer (a dense layer's is filler). :func:`engine_routes` checks that layout
against the sequence at arrival, one clear error instead of experts shifted onto other tokens, and lays it out as
``EngineSamples.routes`` are: [N, MoE layers, Lp + R, k], ``NOT_RECORDED`` where nothing was read.

vLLM 0.32 captures routes only in its V2 model runner, which needs Triton's GPU backend: on CPUs the engines
refuse R3 at setup (:func:`routes_refusal`). Pure functions of arrays and tensors.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from gspo_lightning.moe.rollout_routes import RouteLayoutError, rollout_routes
from gspo_lightning.moe.routing import find_routers

CPU_ROUTES_REFUSAL = (
    "vLLM 0.32 returns routed experts (enable_return_routed_experts) only from its V2 model runner, which needs "
    "Triton's GPU backend: on CPUs use sampler.engine: hf (it records the experts of its own generate forwards), "
    "or model.routing_replay: old (the trainer's pi_old experts)"
)
SERVER_FLAG = "--enable-return-routed-experts"
"""What servers given by ``urls`` must be started with to report routes."""


def routes_refusal(device: torch.device) -> str | None:
    """Why a vLLM engine for a trainer on ``device`` cannot report routed experts; None on CUDA GPUs (where vLLM's
    own config check names anything else it needs, e.g. ``VLLM_USE_V2_MODEL_RUNNER=1``)."""
    return None if device.type == "cuda" else CPU_ROUTES_REFUSAL


def server_without_routes(info: dict, url: str) -> str | None:
    """Why a server (``/server_info?config_format=json`` said ``info``) reports no routed experts; None if it does."""
    aux = (info.get("vllm_config") or {}).get("aux_output_config") or {}
    if aux.get("enable_return_routed_experts"):
        return None
    return f"vLLM server {url} was started without {SERVER_FLAG}: start every server with it (on GPUs)"


def recorded_routes(policy: nn.Module, routing_replay: str, refusal: str | None) -> PolicyRoutes | None:
    """What a vLLM engine for ``policy`` records: the policy's routes under R3 (``routing_replay: rollout``) where
    the engine can (``refusal`` None), else None (the engine is built without them). Only under R3: vLLM's
    routes store costs memory and a copy per step, and refuses some setups (pipeline parallelism, monolithic MoE
    kernels), which a run that replays nothing must not pay for."""
    return PolicyRoutes.of(policy) if routing_replay == "rollout" and refusal is None else None


@dataclass(frozen=True)
class PolicyRoutes:
    """Where a mixture-of-experts policy's routes sit in vLLM's: the decoder layer (vLLM's index) of each router
    in ``find_routers``' order, their top-k and expert count."""

    layers: tuple[int, ...]
    top_k: int
    num_experts: int

    @classmethod
    def of(cls, policy: nn.Module) -> PolicyRoutes | None:
        """``policy``'s, or None for a dense policy (nothing to record)."""
        routers = find_routers(policy)
        if not routers:
            return None
        wanted, layers = {id(router) for router in routers}, []
        for name, module in policy.named_modules():
            if id(module) in wanted:
                match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
                if match is None:
                    raise RouteLayoutError(f"router {name} is in no decoder layer (no 'layers.<i>.' in its name)")
                layers.append(int(match.group(1)))
        return cls(tuple(layers), int(routers[0].top_k), max(int(router.num_experts) for router in routers))


def decode_routes(encoded: str | None) -> np.ndarray | None:
    """A server's ``routed_experts`` (base64 of ``np.save``'s bytes) as an array. The bytes come from the network:
    nothing is unpickled, and the header is read first, so an array claiming more data than the payload holds (an
    allocation of any size from a few bytes) is refused before anything is allocated."""
    if encoded is None:
        return None
    try:
        raw = base64.b64decode(encoded, validate=True)
        header = io.BytesIO(raw)
        version = np.lib.format.read_magic(header)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(header)
    except (binascii.Error, ValueError, OSError, EOFError) as error:
        raise RouteLayoutError(f"a vLLM server's routed_experts is not a base64 .npy array ({error})") from None
    if dtype.kind not in "iu":
        raise RouteLayoutError(f"a vLLM server's routed_experts must hold integers, got {dtype}")
    if math.prod(shape) * dtype.itemsize > len(raw) - header.tell():
        raise RouteLayoutError(f"a vLLM server's routed_experts claims shape {shape} but holds {len(raw)} bytes")
    try:
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise RouteLayoutError(f"a vLLM server's routed_experts is not a base64 .npy array ({error})") from None


def engine_routes(
    arrays: Sequence[np.ndarray | None],
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    prompt_width: int,
    response_width: int,
    policy: PolicyRoutes,
) -> Tensor:
    """Completion i's vLLM routes ``arrays[i]`` [prompt_lengths[i] + response_lengths[i] - 1, decoder layers, k]
    as [N, MoE layers, prompt_width + response_width, k] int16: prompts left-padded to ``prompt_width``, responses
    right-padded to ``response_width``, the policy's MoE layers picked from vLLM's decoder layers."""
    rows = []
    for row, (array, prompt, response) in enumerate(zip(arrays, prompt_lengths, response_lengths, strict=True)):
        rows.append(_checked(array, row, prompt + response - 1, policy))
    return rollout_routes(rows, list(prompt_lengths), prompt_width, response_width)


def _checked(array: np.ndarray | None, row: int, tokens: int, policy: PolicyRoutes) -> Tensor:
    """[MoE layers, tokens, k] int16 from one completion's [tokens, decoder layers, k], or a RouteLayoutError."""
    where = f"the vLLM engine's routed experts for completion {row}"
    if array is None:
        raise RouteLayoutError(f"{where} are missing: was the engine built with enable_return_routed_experts?")
    deepest, k = max(policy.layers), policy.top_k
    if array.ndim != 3 or array.shape[0] != tokens or array.shape[1] <= deepest or array.shape[2] != k:
        raise RouteLayoutError(
            f"{where} have shape {tuple(array.shape)} (tokens, decoder layers, top-k), for a sequence of {tokens + 1} "
            f"tokens (all but its last were read), {deepest + 1} or more decoder layers and top-{k} routing: they "
            "must line up exactly (model.routing_replay: rollout)"
        )
    picked = torch.from_numpy(np.ascontiguousarray(array[:, list(policy.layers)]).astype(np.int64))  # [T, layers, k]
    outside = picked[(picked < 0) | (picked >= policy.num_experts)]
    if outside.numel():  # a hostile or mismatched server: an index the trainer's experts cannot take
        raise RouteLayoutError(
            f"{where} name expert {int(outside[0])}, outside the policy's 0..{policy.num_experts - 1}"
        )
    return picked.permute(1, 0, 2).to(torch.int16 if policy.num_experts < 2**15 else torch.int32)  # [layers, T, k]
