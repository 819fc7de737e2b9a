"""LoRA by per-token adapter slot, read straight from pool pages: the kernels of graph-captured
decode steps, whose launches never depend on the step's adapters or ranks.

Semantics, identical to ``lora.lora_reference`` per module (and to ``triton_lora.py``'s segment
kernels): for token ``t`` with adapter slot ``s = token_slots[t]`` (``-1``: the base model,
nothing added) and each module ``m`` of the group that slot ``s``'s adapter adapts (``r_m > 0``),

    v[t, :R_s]    = x[t] @ A_s^T                                 shrink, A_s = stacked rows [R_s, in]
    out_m[t, :]  += scale_m,s * round(v[t, c_m : c_m + r_m]) @ Bt_m,s    expand, Bt = B^T [r_m, out_m]

Tokens are grouped by slot on the device (``sort_by_slot``), so a program takes up to ``BLOCK_T``
tokens of one adapter and both products are ``tl.dot`` s (Punica's SGMV, the grouping done in the
graph). Each grid's first axis, ``num_tokens / BLOCK_T + num_slots``, bounds the tiles of any
grouping; a program finds its slot by binary search over the slots' tile counts, or returns.

Two launches, each parallel enough that no program walks a long chain of memory waits (a split-K
shrink, as vLLM's and Punica's): the **shrink**, one program per (token tile, ``SHRINK_BLOCK_R``
stacked rows, ``k_chunk`` input columns), writes float32 partial sums ``partials[chunk, t, row]``;
the **expand**, one program per (token tile, module, ``EXPAND_BLOCK_N`` output columns), sums a
rank tile's partials in a fixed order (no atomics: deterministic), rounds them to the working
dtype and multiplies by the B^T tile, over the module's rank. The shrink's rows span
``row_bound``, at least any slot's stacked rows (``lora/slots.py`` keeps it and has the graphs
captured again when it grows), so any rank fits and nothing is padded: programs past a slot's
rows return at once. Weights are found through the slot's page table (element ``e`` of the
adapter's flat layer buffer at ``weights[page_table[e // page_elems], e % page_elems]``): one page
per row and tile where the tiles are aligned (``triton_lora_tiles.aligned_tiles``), else per element.

Arguments (``x``, ``outputs`` and ``weights`` share one float dtype; float32 accumulation):

* ``x``            ``[num_tokens, in_features]`` row-major
* ``outputs``      1-3 tensors ``[num_tokens, out_features_m]``, updated in place
* ``weights``      ``[num_pages, page_elems]``, one layer of the pool storage
* ``token_slots``  ``[num_tokens]`` int64, a slot per token or -1
* ``page_tables``  ``[num_slots, max_pages]`` int64, each slot's adapter pages
* ``meta``         ``[num_slots, 14]`` int64, ``SegmentMeta`` per slot (this layer and group)
* ``scales``       ``[num_slots, num_modules]`` float32
* ``grouping``     ``sort_by_slot(token_slots, num_slots)``, once per step (optional)
* ``row_bound``    host int >= every slot's stacked rows (``meta[:, 1]``); None: read from ``meta``
                   (a device-to-host copy, so not inside a CUDA graph)
* ``k_chunk``      input columns per shrink program, a multiple of its tile width
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraserve.kernels import triton_lora
from loraserve.kernels.lora import SLOT_TILE, SlotGrouping, sort_by_slot
from loraserve.kernels.page_checks import check_range
from loraserve.kernels.triton_lora_tiles import (
    META_A_OFFSET,
    META_NUM_ROWS,
    _add_scaled,
    _dot,
    _load_weight_tiles,
    _module_meta,
    _shrink_tile,
    check_arguments,
    launch_settings,
)
from loraserve.kernels.triton_slot_tiles import find_slot, slot_tokens

BLOCK_T = SLOT_TILE  # tokens of one slot per program (tl.dot needs at least 16 rows)
SHRINK_BLOCK_R = 32  # stacked A rows per shrink program
SHRINK_WIDTHS = triton_lora.SHRINK_WIDTHS  # input columns per step of the shrink (shrink_width)
K_CHUNK = 512  # input columns per shrink program: 8 steps of 64 (not yet timed on a GPU)
EXPAND_BLOCK_N, EXPAND_BLOCK_R = 64, 16  # output columns per expand program, rank rows per step
# Integers a step may change (the slot count, the tables' widths, the intermediate's strides: the
# step's tokens and the row bound), and metadata pointers: never specialised (one variant each).
PER_STEP_INTEGERS = ["num_slots", "stride_table", "stride_part_chunk", "stride_part_token"]
TABLE_POINTERS = ["order_ptr", "starts_ptr", "tile_ends_ptr", "page_tables_ptr", "meta_ptr"]


@triton.jit(
    do_not_specialize=PER_STEP_INTEGERS,
    do_not_specialize_on_alignment=TABLE_POINTERS,
)
def _slot_shrink_kernel(
    x_ptr,
    part_ptr,
    weights_ptr,
    order_ptr,
    starts_ptr,
    tile_ends_ptr,
    page_tables_ptr,
    meta_ptr,
    num_slots,
    in_features,
    k_chunk,
    stride_x,
    stride_part_chunk,
    stride_part_token,
    stride_table,
    stride_meta,
    PAGE_ELEMS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    slot = find_slot(tile_ends_ptr, num_slots, tl.program_id(0))
    if slot < num_slots:
        tokens, token_mask = slot_tokens(order_ptr, starts_ptr, tile_ends_ptr, slot, BLOCK_T)
        slot_meta = meta_ptr + slot * stride_meta
        num_rows = tl.load(slot_meta + META_NUM_ROWS)
        first_row = tl.program_id(1) * BLOCK_R
        if first_row < num_rows:
            a_offset = tl.load(slot_meta + META_A_OFFSET)
            rows = first_row + tl.arange(0, BLOCK_R)  # [BLOCK_R]
            row_mask = rows < num_rows
            row_starts = a_offset + rows * in_features  # [BLOCK_R], where each A row starts
            table = page_tables_ptr + slot * stride_table
            chunk = tl.program_id(2)
            k_end = tl.minimum(chunk * k_chunk + k_chunk, in_features)
            acc = _shrink_tile(
                x_ptr, stride_x, tokens, token_mask, weights_ptr, table, row_starts, row_mask, chunk * k_chunk, k_end,
                in_features, BLOCK_T, BLOCK_R, BLOCK_K, PAGE_ELEMS, PRECISION, DOT_FP32, ALIGNED,
            )  # [BLOCK_T, BLOCK_R]  # fmt: skip
            part_ptrs = part_ptr + chunk * stride_part_chunk + tokens[:, None] * stride_part_token + rows[None, :]
            tl.store(part_ptrs, acc, mask=token_mask[:, None] & row_mask[None, :])


@triton.jit(
    do_not_specialize=[*PER_STEP_INTEGERS, "num_chunks", "num_col_blocks"],
    do_not_specialize_on_alignment=[*TABLE_POINTERS, "scales_ptr"],
)
def _slot_expand_kernel(
    part_ptr,
    out0_ptr,
    out1_ptr,
    out2_ptr,
    weights_ptr,
    order_ptr,
    starts_ptr,
    tile_ends_ptr,
    page_tables_ptr,
    meta_ptr,
    scales_ptr,
    num_slots,
    num_chunks,
    num_col_blocks,
    stride_part_chunk,
    stride_part_token,
    stride_out0,
    stride_out1,
    stride_out2,
    stride_table,
    stride_meta,
    stride_scales,
    PAGE_ELEMS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    slot = find_slot(tile_ends_ptr, num_slots, tl.program_id(0))
    if slot < num_slots:
        tokens, token_mask = slot_tokens(order_ptr, starts_ptr, tile_ends_ptr, slot, BLOCK_T)
        module = tl.program_id(1) // num_col_blocks
        first_col = (tl.program_id(1) % num_col_blocks) * BLOCK_N
        column, rank, b_offset, out_features = _module_meta(meta_ptr + slot * stride_meta, module, BLOCK_N, ALIGNED)
        if (rank > 0) & (first_col < out_features):
            cols = first_col + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            chunks = tl.arange(0, CHUNKS)  # [CHUNKS]
            table = page_tables_ptr + slot * stride_table
            acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
            for r in range(0, rank, BLOCK_R):
                ranks = r + tl.arange(0, BLOCK_R)  # [BLOCK_R]
                rank_mask = ranks < rank
                part_ptrs = (
                    part_ptr
                    + chunks[:, None, None] * stride_part_chunk
                    + tokens[None, :, None] * stride_part_token
                    + (column + ranks)[None, None, :]
                )  # [CHUNKS, BLOCK_T, BLOCK_R]
                part_mask = (chunks < num_chunks)[:, None, None] & (token_mask[:, None] & rank_mask[None, :])[None]
                v = tl.sum(tl.load(part_ptrs, mask=part_mask, other=0.0), axis=0)  # [BLOCK_T, BLOCK_R]
                row_starts = b_offset + ranks * out_features  # [BLOCK_R], each B^T row
                b = _load_weight_tiles(
                    weights_ptr, table, row_starts, first_col, out_features, rank_mask, BLOCK_N, PAGE_ELEMS, ALIGNED
                )  # [BLOCK_R, BLOCK_N]
                v_low = v.to(out0_ptr.dtype.element_ty)  # rounded as the reference's shrink output
                acc = _dot(v_low, b, acc, PRECISION, DOT_FP32)  # [BLOCK_T, BLOCK_N]
            scale = tl.load(scales_ptr + slot * stride_scales + module)
            out_mask = token_mask[:, None] & (cols < out_features)[None, :]
            _add_scaled(
                out0_ptr, out1_ptr, out2_ptr, stride_out0, stride_out1, stride_out2, module, tokens, cols, out_mask,
                acc, scale,
            )  # fmt: skip


def row_tiles(row_bound: int) -> int:
    """Shrink programs per token tile and chunk along the stacked rows."""
    return triton.cdiv(row_bound, SHRINK_BLOCK_R)


def lora_slots(
    x: torch.Tensor,  # [num_tokens, in_features]
    outputs: tuple[torch.Tensor, ...],  # 1-3 of [num_tokens, out_features_m], updated in place
    weights: torch.Tensor,  # [num_pages, page_elems]
    token_slots: torch.Tensor,  # [num_tokens] int64
    page_tables: torch.Tensor,  # [num_slots, max_pages] int64
    meta: torch.Tensor,  # [num_slots, 14] int64
    scales: torch.Tensor,  # [num_slots, num_modules] float32
    grouping: SlotGrouping | None = None,
    row_bound: int | None = None,
    k_chunk: int = K_CHUNK,
    gather_elements: bool = False,
) -> None:
    """Add each token's adapter delta to ``outputs`` (see the module docstring).
    ``gather_elements``: load element by element even where the tiles are aligned (to compare)."""
    check_arguments("lora_slots", x, outputs, weights, page_tables)
    num_tokens, num_slots = x.shape[0], page_tables.shape[0]
    if num_tokens == 0:
        return
    check_range("lora_slots token_slots", token_slots, -1, num_slots)
    if row_bound is None:
        row_bound = int(meta[:, META_NUM_ROWS.value].max())
    else:
        check_range("lora_slots stacked rows", meta[:, META_NUM_ROWS.value], 0, row_bound + 1)
    if row_bound == 0:
        return
    grouping = grouping if grouping is not None else sort_by_slot(token_slots, num_slots)
    settings = launch_settings("lora_slots", x, outputs, weights, meta, SHRINK_WIDTHS, EXPAND_BLOCK_N, gather_elements)
    in_features = x.shape[1]
    if k_chunk <= 0 or k_chunk % settings.block_k:
        raise ValueError(f"lora_slots k_chunk must be a positive multiple of {settings.block_k}, got {k_chunk}")
    num_chunks = triton.cdiv(in_features, k_chunk)
    partials = torch.empty(num_chunks, num_tokens, row_bound, dtype=torch.float32, device=x.device)
    num_tiles = triton.cdiv(num_tokens, BLOCK_T) + min(num_tokens, num_slots)
    tables = (grouping.order, grouping.starts, grouping.tile_ends, page_tables, meta)
    _slot_shrink_kernel[(num_tiles, row_tiles(row_bound), num_chunks)](
        x,
        partials,
        weights,
        *tables,
        num_slots,
        in_features,
        k_chunk,
        x.stride(0),
        partials.stride(0),
        partials.stride(1),
        page_tables.stride(0),
        meta.stride(0),
        PAGE_ELEMS=settings.page_elems,
        BLOCK_T=BLOCK_T,
        BLOCK_R=SHRINK_BLOCK_R,
        BLOCK_K=settings.block_k,
        PRECISION=settings.precision,
        DOT_FP32=settings.dot_fp32,
        ALIGNED=settings.a_aligned,
    )
    padded = settings.outputs  # absent modules: no program runs them
    _slot_expand_kernel[(num_tiles, len(outputs) * settings.num_col_blocks)](
        partials,
        padded[0],
        padded[1],
        padded[2],
        weights,
        *tables,
        scales,
        num_slots,
        num_chunks,
        settings.num_col_blocks,
        partials.stride(0),
        partials.stride(1),
        padded[0].stride(0),
        padded[1].stride(0),
        padded[2].stride(0),
        page_tables.stride(0),
        meta.stride(0),
        scales.stride(0),
        PAGE_ELEMS=settings.page_elems,
        BLOCK_T=BLOCK_T,
        BLOCK_R=EXPAND_BLOCK_R,
        BLOCK_N=EXPAND_BLOCK_N,
        CHUNKS=triton.next_power_of_2(num_chunks),
        PRECISION=settings.precision,
        DOT_FP32=settings.dot_fp32,
        ALIGNED=settings.b_aligned,
    )
