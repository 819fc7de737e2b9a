"""Segmented LoRA read straight from pool pages: two Triton kernels (shrink, expand).

Semantics, identical to ``lora.apply_lora_segments`` / ``lora.lora_reference``: for each
segment ``s`` (tokens ``start_s:end_s``, all of one adapter) of one layer's input group,

    v[t, :R_s]        = x[t] @ A_s^T                          shrink, A_s = stacked rows [R_s, in]
    out_m[t, :]      += scale_m,s * v[t, c_m : c_m + r_m] @ Bt_m,s   expand, Bt = B^T [r_m, out_m]

for ``t`` in the segment and every module ``m`` of the group the adapter adapts. Nothing is
padded to a maximum rank: each segment multiplies at its own ranks (the kernels skip the
row and column tiles past them).

The weights are never copied out of the pool. An adapter's flat layer buffer (see
``lora/layout.py``) is its pages concatenated, so element ``e`` of it sits at
``weights[page_table[e // page_elems], e % page_elems]``, which both kernels follow for
every element they load; rows may cross page boundaries. Where a matrix's rows and the page
are multiples of the kernel's tile width (``aligned_tiles``: every projection of real models),
each tile of a row lies inside one page, as ``lora/layout.py`` aligns every matrix to
``WEIGHT_ALIGN``: the kernels then look up one page per row and tile and load the tile as one
contiguous run (16-byte asynchronous copies, pipelined across the loop, on the GPU).

Arguments (``x``, ``outputs`` and ``weights`` share one float dtype; float32 dots run in
IEEE precision so results match the float32 reference to rounding):

* ``x``           ``[num_tokens, in_features]``
* ``outputs``     1-3 tensors ``[num_tokens, out_features_m]``, updated in place
* ``weights``     ``[num_pages, page_elems]``, one layer of the pool storage
* ``bounds``      ``[num_segments, 4]`` int64: ``start, end`` (the other two columns unused here)
* ``page_tables`` ``[num_segments, max_pages]`` int64, each segment's adapter pages
* ``meta``        ``[num_segments, 2 + 4 * num_modules]`` int64 (14 wide in the engine):
                  ``a_offset, num_rows``, then per module ``column, rank, b_offset, out_features``
                  (rank 0: not adapted)
* ``scales``      ``[num_segments, num_modules]`` float32
* ``max_segment_len``, ``max_rows``: host ints bounding the grid (longest segment, most rows)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
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

BLOCK_T = 16  # tokens per tile (tl.dot needs at least 16)
SHRINK_BLOCK_R = 32
# Input columns per step of a shrink's loop: the widest of these whose tiles are aligned
# (``shrink_width``). Wider tiles shorten a program's serial loop, whose steps wait on memory;
# (256, 128, 64) is built and tested but not yet timed on a GPU (benchmarks.gpu sweeps it).
SHRINK_WIDTHS: tuple[int, ...] = (64,)
WIDE_SHRINK_WIDTHS = (256, 128, 64)
EXPAND_BLOCK_N, EXPAND_BLOCK_R = 64, 16


@triton.jit(
    do_not_specialize=["stride_v", "stride_table"],
    do_not_specialize_on_alignment=["bounds_ptr", "page_tables_ptr", "meta_ptr"],
)
def _shrink_kernel(
    x_ptr,
    v_ptr,
    weights_ptr,
    bounds_ptr,
    page_tables_ptr,
    meta_ptr,
    in_features,
    stride_x,
    stride_v,
    stride_table,
    stride_meta,
    PAGE_ELEMS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    segment = tl.program_id(0)
    first_token = tl.load(bounds_ptr + segment * 4) + tl.program_id(1) * BLOCK_T
    end = tl.load(bounds_ptr + segment * 4 + 1)
    a_offset = tl.load(meta_ptr + segment * stride_meta + META_A_OFFSET)
    num_rows = tl.load(meta_ptr + segment * stride_meta + META_NUM_ROWS)
    first_row = tl.program_id(2) * BLOCK_R
    if (first_token < end) & (first_row < num_rows):
        tokens = first_token + tl.arange(0, BLOCK_T)  # [BLOCK_T]
        rows = first_row + tl.arange(0, BLOCK_R)  # [BLOCK_R]
        token_mask = tokens < end
        row_mask = rows < num_rows
        table = page_tables_ptr + segment * stride_table
        row_starts = a_offset + rows * in_features  # [BLOCK_R], where each A row starts
        acc = _shrink_tile(
            x_ptr, stride_x, tokens, token_mask, weights_ptr, table, row_starts, row_mask, 0, in_features, in_features,
            BLOCK_T, BLOCK_R, BLOCK_K, PAGE_ELEMS, PRECISION, DOT_FP32, ALIGNED,
        )  # [BLOCK_T, BLOCK_R]  # fmt: skip
        tl.store(
            v_ptr + tokens[:, None] * stride_v + rows[None, :],
            acc.to(v_ptr.dtype.element_ty),
            mask=token_mask[:, None] & row_mask[None, :],
        )


@triton.jit(
    do_not_specialize=["stride_v", "stride_table"],
    do_not_specialize_on_alignment=["bounds_ptr", "page_tables_ptr", "meta_ptr", "scales_ptr"],
)
def _expand_kernel(
    v_ptr,
    out0_ptr,
    out1_ptr,
    out2_ptr,
    weights_ptr,
    bounds_ptr,
    page_tables_ptr,
    meta_ptr,
    scales_ptr,
    stride_v,
    stride_out0,
    stride_out1,
    stride_out2,
    stride_table,
    stride_meta,
    stride_scales,
    num_col_blocks,
    PAGE_ELEMS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    segment = tl.program_id(0)
    first_token = tl.load(bounds_ptr + segment * 4) + tl.program_id(1) * BLOCK_T
    end = tl.load(bounds_ptr + segment * 4 + 1)
    module = tl.program_id(2) // num_col_blocks
    first_col = (tl.program_id(2) % num_col_blocks) * BLOCK_N
    column, rank, b_offset, out_features = _module_meta(meta_ptr + segment * stride_meta, module, BLOCK_N, ALIGNED)
    if (first_token < end) & (rank > 0) & (first_col < out_features):
        tokens = first_token + tl.arange(0, BLOCK_T)  # [BLOCK_T]
        cols = first_col + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        token_mask = tokens < end
        col_mask = cols < out_features
        table = page_tables_ptr + segment * stride_table
        acc = tl.zeros((BLOCK_T, BLOCK_N), tl.float32)
        for r in range(0, rank, BLOCK_R):
            ranks = r + tl.arange(0, BLOCK_R)  # [BLOCK_R]
            rank_mask = ranks < rank
            v = tl.load(
                v_ptr + tokens[:, None] * stride_v + column + ranks[None, :],
                mask=token_mask[:, None] & rank_mask[None, :],
                other=0.0,
            )  # [BLOCK_T, BLOCK_R]
            row_starts = b_offset + ranks * out_features  # [BLOCK_R]
            b = _load_weight_tiles(
                weights_ptr, table, row_starts, first_col, out_features, rank_mask, BLOCK_N, PAGE_ELEMS, ALIGNED
            )
            acc = _dot(v, b, acc, PRECISION, DOT_FP32)  # [BLOCK_T, BLOCK_N]
        scale = tl.load(scales_ptr + segment * stride_scales + module)
        out_mask = token_mask[:, None] & col_mask[None, :]
        _add_scaled(
            out0_ptr, out1_ptr, out2_ptr, stride_out0, stride_out1, stride_out2, module, tokens, cols, out_mask, acc,
            scale,
        )  # fmt: skip


def lora_segments(
    x: torch.Tensor,  # [num_tokens, in_features]
    outputs: tuple[torch.Tensor, ...],  # 1-3 of [num_tokens, out_features_m], updated in place
    weights: torch.Tensor,  # [num_pages, page_elems], one layer of the pool storage
    bounds: torch.Tensor,  # [num_segments, 4] int64
    page_tables: torch.Tensor,  # [num_segments, max_pages] int64
    meta: torch.Tensor,  # [num_segments, 2 + 4 * num_modules] int64
    scales: torch.Tensor,  # [num_segments, num_modules] float32
    max_segment_len: int,
    max_rows: int,
    gather_elements: bool = False,
) -> None:
    """Add every segment's LoRA delta to its rows of ``outputs`` (see the module docstring).
    ``gather_elements``: load element by element even where the tiles are aligned (to compare)."""
    check_arguments("lora_segments", x, outputs, weights, page_tables)
    num_segments = bounds.shape[0]
    if num_segments == 0 or max_rows == 0:
        return
    settings = launch_settings(
        "lora_segments", x, outputs, weights, meta, SHRINK_WIDTHS, EXPAND_BLOCK_N, gather_elements
    )
    num_token_tiles = triton.cdiv(max_segment_len, BLOCK_T)
    v = torch.empty(x.shape[0], max_rows, dtype=x.dtype, device=x.device)  # [num_tokens, max_rows]
    _shrink_kernel[(num_segments, num_token_tiles, triton.cdiv(max_rows, SHRINK_BLOCK_R))](
        x,
        v,
        weights,
        bounds,
        page_tables,
        meta,
        x.shape[1],
        x.stride(0),
        v.stride(0),
        page_tables.stride(0),
        meta.stride(0),
        PAGE_ELEMS=settings.page_elems,
        PRECISION=settings.precision,
        BLOCK_T=BLOCK_T,
        BLOCK_R=SHRINK_BLOCK_R,
        BLOCK_K=settings.block_k,
        DOT_FP32=settings.dot_fp32,
        ALIGNED=settings.a_aligned,
    )
    padded = settings.outputs  # absent modules have rank 0 in meta
    _expand_kernel[(num_segments, num_token_tiles, len(outputs) * settings.num_col_blocks)](
        v,
        padded[0],
        padded[1],
        padded[2],
        weights,
        bounds,
        page_tables,
        meta,
        scales,
        v.stride(0),
        padded[0].stride(0),
        padded[1].stride(0),
        padded[2].stride(0),
        page_tables.stride(0),
        meta.stride(0),
        scales.stride(0),
        settings.num_col_blocks,
        PAGE_ELEMS=settings.page_elems,
        PRECISION=settings.precision,
        BLOCK_T=BLOCK_T,
        BLOCK_N=EXPAND_BLOCK_N,
        BLOCK_R=EXPAND_BLOCK_R,
        DOT_FP32=settings.dot_fp32,
        ALIGNED=settings.b_aligned,
    )
