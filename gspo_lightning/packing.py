"""Padding-free layout of a minibatch: its sequences laid end to end in rows, attention kept inside each one.

A padded minibatch is an [n, L] rectangle: left-padded prompts, right-padded responses, the longest sequence
setting L for all. Packed, the same real tokens fill [B, S] rows with B <= n and S = L (a row holds as many whole
sequences as fit; none is split), so every forward and backward pays for tokens, not padding.

Attention stays inside each sequence through the position ids alone: they restart at 0 for each sequence, and
Hugging Face's masks (``masking_utils.find_packed_sequence_indices``, used when the 2D attention mask is None)
turn every restart into a block of the causal mask, for sdpa and eager, and flash attention reads the same
boundaries. The positions are those the padded forward uses (``position_ids_from_mask``), so packed and padded
forwards compute the same function of each sequence. A row's unused tail is one more "sequence" of padding
tokens, which no real token attends to.

Pure functions of tensors: no model, no state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PackedRows:
    """The real tokens of a padded [n, L] batch, packed.

    Attributes:
        input_ids:    [B, S] the sequences' tokens end to end; a row's tail holds ``pad_token``.
        position_ids: [B, S] each sequence's positions 0 .. len - 1; the tail's restart at 0 too.
        packed_index: [n, L] int64, where each token of the padded batch went in the flattened [B * S] rows,
                      -1 on padding.
    """

    input_ids: Tensor
    position_ids: Tensor
    packed_index: Tensor


def row_assignment(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequences (by index) per row, first-fit decreasing: longest first, each into the first row with room.

    Deterministic (ties keep their index order), so pi_old's pass and pi_theta's pass pack a minibatch the same
    way. Every length must be at most ``capacity``."""
    if lengths and max(lengths) > capacity:
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit in rows of {capacity}")
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = next((r for r, free in enumerate(room) if free >= lengths[index]), None)
        if target is None:
            rows.append([])
            room.append(capacity)
            target = len(rows) - 1
        rows[target].append(index)
        room[target] -= lengths[index]
    return [sorted(row) for row in rows]  # in a row, sequences in batch order


def pack(input_ids: Tensor, attention_mask: Tensor, capacity: int | None = None, pad_token: int = 0) -> PackedRows:
    """Pack the attended tokens of each row of ``input_ids`` ([n, L]) into rows of at most ``capacity`` tokens.

    Args:
        input_ids: [n, L] the padded batch.
        attention_mask: [n, L] 1 on real tokens. A sequence's real tokens are kept in order; what lies between
            them (nothing, for prompts and responses) is dropped.
        capacity: tokens per packed row; default L, so no row is longer than the padded batch's, and attention
            (quadratic in the row) never costs more than padded.
    """
    mask = attention_mask.bool()  # [n, L]
    lengths = mask.sum(-1).tolist()
    capacity = capacity or input_ids.shape[1]
    rows = row_assignment(lengths, capacity)
    width = max((sum(lengths[i] for i in row) for row in rows), default=0)
    packed_index = torch.full(input_ids.shape, -1, dtype=torch.long, device=input_ids.device)  # [n, L]
    positions = torch.zeros(len(rows), width, dtype=torch.long, device=input_ids.device)  # [B, S]
    for r, row in enumerate(rows):
        offset = 0  # within the row
        for i in row:
            packed_index[i, mask[i]] = torch.arange(offset, offset + lengths[i], device=input_ids.device) + r * width
            positions[r, offset : offset + lengths[i]] = torch.arange(lengths[i])
            offset += lengths[i]
        positions[r, offset:] = torch.arange(width - offset)
    flat_ids = torch.full((len(rows) * width,), pad_token, dtype=input_ids.dtype, device=input_ids.device)
    flat_ids[packed_index[mask]] = input_ids[mask]
    return PackedRows(flat_ids.view(len(rows), width), positions, packed_index)


def unpack(packed_values: Tensor, packed: PackedRows, fill: float = 0.0) -> Tensor:
    """Values of the packed tokens ([B, S, ...]) back in the padded layout ([n, L, ...]), ``fill`` on padding."""
    flat = packed_values.reshape(-1, *packed_values.shape[2:])  # [B * S, ...]
    index = packed.packed_index  # [n, L]
    out = flat.new_full((*index.shape, *flat.shape[1:]), fill)  # [n, L, ...]
    real = index >= 0
    out[real] = flat[index[real]]
    return out


def response_predictors(packed: PackedRows, attention_mask: Tensor, response_length: int) -> tuple[Tensor, Tensor]:
    """Which packed positions predict the attended response tokens, and where those tokens are in [n, R].

    Position j of a sequence predicts token j + 1, so response token t (column L - R + t) is predicted by the
    hidden state of column L - R + t - 1 of the same sequence: the last prompt token for t = 0.

    Returns:
        predictor: [M] int64 index into the flattened [B * S] packed rows.
        target: [M] int64 index into the flattened [n, R] responses (row-major: response by response).
    """
    n, length = attention_mask.shape
    scored = attention_mask[:, length - response_length :].bool()  # [n, R]
    target = scored.reshape(-1).nonzero().squeeze(-1)  # [M]
    row, column = target // response_length, target % response_length + length - response_length - 1  # [M]
    predictor = packed.packed_index[row, column]  # [M]
    if bool((predictor < 0).any()):
        raise ValueError("a response token is not preceded by a real token of its sequence (an empty prompt?)")
    return predictor, target
