"""Batched LoRA for tokens of many adapters of different ranks: torch implementations.

Semantics (Punica's SGMV/BGMV), for token ``t`` using adapter ``a(t)`` (or none):

    v[t]     = x[t] @ A[a(t)].T                       shrink, rank r_a(t)
    y_m[t]  += scale_m[a(t)] * v_m[t] @ B_m[a(t)].T    expand, per output module m

Projections that read the same input (q/k/v; gate/up) share one shrink over their
A matrices stacked by rows; ``v_m`` is module m's column slice of ``v``. Nothing is
padded: each adapter is multiplied at its own rank.

``apply_lora_segments`` is the CPU serving path: tokens of one adapter are
contiguous (the runner orders the batch that way), so each segment is two small
GEMMs on views of the pool pages. ``lora_reference`` is the float32 per-token
reference that every implementation (and the GPU kernels) is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class SegmentMeta:
    """The per-segment LoRA metadata of one layer and input group, as the compiled CPU kernel
    (``kernels/csrc/lora_tiled.h``) and the Triton kernels (``kernels/triton_lora.py``) read it:
    one int64 row ``[a_offset, num_rows, then per module: column, rank, b_offset, out_features]``
    (rank 0: the module is not adapted). Defined here once; tests check both mirrors against it."""

    A_OFFSET = 0  # where the group's stacked A rows start in the adapter's flat layer buffer
    NUM_ROWS = 1  # stacked A rows (the sum of the group's ranks)
    MODULE_BASE = 2  # module m's fields start at MODULE_BASE + MODULE_STRIDE * m
    MODULE_STRIDE = 4
    COLUMN, RANK, B_OFFSET, OUT_FEATURES = 0, 1, 2, 3  # within a module's fields
    MAX_MODULES = 3  # q/k/v
    WIDTH = MODULE_BASE + MODULE_STRIDE * MAX_MODULES  # 14


WEIGHT_ALIGN = 64
"""A group's stacked A or a module's B^T whose rows are a multiple of this many elements long
starts at a multiple of it in an adapter's flat layer buffer (``lora/layout.py`` pads to it).
Where a page holds a multiple of it too, no run of ``WEIGHT_ALIGN`` elements at an aligned
column of such a matrix crosses a page: the Triton kernels then find one page per row and tile,
and load the tile contiguously (``triton_lora_tiles.aligned_tiles``)."""


class OutputSlice(NamedTuple):
    """Where module m's rank columns sit in ``v`` and its expand weights."""

    column: int
    rank: int
    b_t: torch.Tensor  # [rank, out_features], B transposed
    scale: float


class LoRASegment(NamedTuple):
    """Tokens ``start:end`` of the batch all use one adapter."""

    start: int
    end: int
    a: torch.Tensor  # [sum of the group's ranks, in_features], stacked A rows
    outputs: tuple[OutputSlice | None, ...]  # one per output tensor; None where not adapted


def apply_lora_segments(
    x: torch.Tensor,  # [num_tokens, in_features]
    outputs: tuple[torch.Tensor, ...],  # each [num_tokens, out_features_m], updated in place
    segments: list[LoRASegment],
) -> None:
    """Add every segment's LoRA delta to its rows of ``outputs``.

    Two GEMM kinds per segment and nothing else: ``v = x_seg @ A^T`` (one for the whole
    input group), then ``out_m[seg] += scale_m * v_m @ B_m^T`` fused into one ``addmm_``
    per projection. This loop runs once per adapter present in the step (NamedTuples,
    no allocation beyond ``v``), which keeps its Python cost to a few microseconds a GEMM.
    """
    for start, end, a, parts in segments:
        v = torch.mm(x[start:end], a.t())  # [segment_len, sum_r]
        for out, part in zip(outputs, parts, strict=True):
            if part is not None:
                out[start:end].addmm_(v[:, part.column : part.column + part.rank], part.b_t, alpha=part.scale)


def lora_reference(
    x: torch.Tensor,  # [num_tokens, in_features]
    adapter_indices: torch.Tensor,  # [num_tokens] int64, -1 for no adapter
    lora_a: list[torch.Tensor],  # per adapter [rank_i, in_features]
    lora_b: list[torch.Tensor],  # per adapter [out_features, rank_i]
    scales: list[float],
    v_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [num_tokens, out_features] float32, the delta only
    """Per-token float32 reference: ``delta[t] = scale * (x[t] @ A.T) @ B.T`` of adapter a(t), with
    ``v = x[t] @ A.T`` rounded to ``v_dtype`` before the expand (float32: not rounded)."""
    out_features = lora_b[0].shape[0] if lora_b else 0
    delta = torch.zeros(x.shape[0], out_features, dtype=torch.float32)
    for t, index in enumerate(adapter_indices.tolist()):
        if index < 0:
            continue
        v = (x[t].float() @ lora_a[index].float().T).to(v_dtype).float()  # [rank]
        delta[t] = scales[index] * (v @ lora_b[index].float().T)
    return delta


SLOT_TILE = 16  # tokens per tile of the slot kernel (kernels/triton_lora_slots.py)


@dataclass(frozen=True)
class SlotGrouping:
    """The step's tokens grouped by adapter slot (device tensors, made by ``sort_by_slot``)."""

    order: torch.Tensor  # [num_tokens] int64: token indices, sorted by slot (slot -1 first)
    starts: torch.Tensor  # [num_slots + 1] int64: slot s's tokens are order[starts[s] : starts[s + 1]]
    tile_ends: torch.Tensor  # [num_slots] int64: cumulative count of SLOT_TILE-token tiles, slot by slot


def sort_by_slot(token_slots: torch.Tensor, num_slots: int) -> SlotGrouping:
    """Group tokens by slot on the device: no host copy, fixed shapes (a CUDA graph records it)."""
    sorted_slots, order = torch.sort(token_slots, stable=True)  # [num_tokens] each
    bounds = torch.arange(num_slots + 1, device=token_slots.device)  # [num_slots + 1]
    starts = torch.searchsorted(sorted_slots, bounds)  # first sorted position of each slot
    tiles = torch.div(starts[1:] - starts[:-1] + SLOT_TILE - 1, SLOT_TILE, rounding_mode="floor")  # [num_slots]
    return SlotGrouping(order, starts, torch.cumsum(tiles, 0))
