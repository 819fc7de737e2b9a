"""LoRA by per-token adapter slot, read straight from pool pages: the kernel of graph-captured
decode steps, whose launch never depends on the step's adapters or ranks.

Semantics, identical to ``lora.lora_reference`` per module: for token ``t`` with adapter slot
``s = token_slots[t]`` (``-1``: the base model, nothing added) and each module ``m`` of the
layer's input group that slot ``s``'s adapter adapts (rank ``r_m > 0``),

    out_m[t, :] += scale_m,s * (x[t] @ A_m,s^T) @ Bt_m,s      A_m,s = stacked A rows c_m .. c_m + r_m

Tokens are grouped by slot on the device first (``sort_by_slot``: a stable sort, each slot's
range of the sorted order, its tiles of ``BLOCK_T`` tokens), so a program takes up to ``BLOCK_T``
tokens of one adapter and both products are ``tl.dot`` s: an adapter's weights are read once per
tile of its tokens, not once per token (Punica's SGMV, with the grouping done in the graph). The
grid, ``(num_tokens / BLOCK_T + num_slots, num_modules * N_SPLIT)``, is an upper bound on the
tiles of any grouping; a program finds its slot by binary search over the slots' tile counts and
returns when it has none, so the launch depends only on the batch's (padded) size and the group's
shapes. The rank loop runs inside the kernel (``BLOCK_R`` rank rows at a time: their shrink over
the input, then their expand into this program's output columns), so there is no maximum rank and
nothing is padded. A slot's weights are found through its page table
(``weights[page_table[e // page_elems], e % page_elems]`` for element ``e`` of the adapter's flat
layer buffer, ``lora/layout.py``), wherever its pages are: one page per row and tile where the
tiles are aligned (``triton_lora_tiles.aligned_tiles``), element by element otherwise.

Arguments (``x``, ``outputs`` and ``weights`` share one float dtype; float32 accumulation, the
shrink's result rounded to that dtype before the expand, as the segment kernels do):

* ``x``            ``[num_tokens, in_features]`` row-major
* ``outputs``      1-3 tensors ``[num_tokens, out_features_m]``, updated in place
* ``weights``      ``[num_pages, page_elems]``, one layer of the pool storage
* ``token_slots``  ``[num_tokens]`` int64, a slot per token or -1
* ``page_tables``  ``[num_slots, max_pages]`` int64, each slot's adapter pages
* ``meta``         ``[num_slots, 14]`` int64, ``kernels/lora.py: SegmentMeta`` per slot (this layer
                   and group; rank 0: module not adapted)
* ``scales``       ``[num_slots, num_modules]`` float32
* ``grouping``     ``sort_by_slot(token_slots, num_slots)``, computed once per step (optional)

Each program owns the output columns ``n`` with ``n // BLOCK_N ≡ split (mod N_SPLIT)`` of one
module for its tokens: no two programs write the same element (no atomics). The shrink of a
rank tile is recomputed by the ``N_SPLIT`` programs of a module, which keeps steps of few
tokens parallel; for the small ranks of LoRA this costs less than a round trip through memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraserve.kernels import triton_lora
from loraserve.kernels.lora import SLOT_TILE, SlotGrouping, sort_by_slot
from loraserve.kernels.page_checks import check_range
from loraserve.kernels.triton_attention import runs_interpreted
from loraserve.kernels.triton_lora_tiles import (
    META_A_OFFSET,
    META_B_OFFSET,
    META_COLUMN,
    META_MODULE_BASE,
    META_MODULE_STRIDE,
    META_OUT_FEATURES,
    META_RANK,
    _dot,
    _load_weight_tiles,
    alignment,
    check_arguments,
    shrink_width,
)

BLOCK_T = SLOT_TILE  # tokens of one slot per program (tl.dot needs at least 16 rows)
# BLOCK_R and MAX_SPLIT: the fastest of benchmarks.gpu's sweep on an H100 (benchmarks/RESULTS.md).
BLOCK_R = 32  # rank rows per step of the rank loop
SHRINK_WIDTHS = triton_lora.SHRINK_WIDTHS  # input columns per step of the shrink (shrink_width)
BLOCK_N = 64  # output columns per step of the expand
MAX_SPLIT = 4  # programs per (token tile, module), each taking every MAX_SPLIT-th column tile


@triton.jit
def _find_slot(tile_ends_ptr, num_slots, tile):
    """The first slot ``s`` with ``tile_ends[s] > tile`` (binary search); ``num_slots`` if none."""
    low = 0
    high = num_slots
    while low < high:
        mid = (low + high) // 2
        if tl.load(tile_ends_ptr + mid) <= tile:
            low = mid + 1
        else:
            high = mid
    return low


@triton.jit(
    do_not_specialize=["num_slots", "stride_table"],
    do_not_specialize_on_alignment=[
        "order_ptr",
        "starts_ptr",
        "tile_ends_ptr",
        "page_tables_ptr",
        "meta_ptr",
        "scales_ptr",
    ],
)
def _lora_slots_kernel(
    x_ptr,
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
    in_features,
    stride_x,
    stride_out0,
    stride_out1,
    stride_out2,
    stride_table,
    stride_meta,
    stride_scales,
    PAGE_ELEMS: tl.constexpr,
    N_SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    A_ALIGNED: tl.constexpr,
    B_ALIGNED: tl.constexpr,
):
    tile_index = tl.program_id(0)
    module = tl.program_id(1) // N_SPLIT
    split = tl.program_id(1) % N_SPLIT
    slot = _find_slot(tile_ends_ptr, num_slots, tile_index)
    if slot < num_slots:
        first_tile = tl.load(tile_ends_ptr + slot - 1, mask=slot > 0, other=0)  # tiles of the slots before
        slot_end = tl.load(starts_ptr + slot + 1)
        positions = tl.load(starts_ptr + slot) + (tile_index - first_tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        token_mask = positions < slot_end  # [BLOCK_T]
        tokens = tl.load(order_ptr + positions, mask=token_mask, other=0)  # [BLOCK_T]
        slot_meta = meta_ptr + slot * stride_meta
        module_meta = slot_meta + META_MODULE_BASE + META_MODULE_STRIDE * module
        a_offset = tl.load(slot_meta + META_A_OFFSET)
        column = tl.load(module_meta + META_COLUMN)
        rank = tl.load(module_meta + META_RANK)
        b_offset = tl.load(module_meta + META_B_OFFSET)
        out_features = tl.load(module_meta + META_OUT_FEATURES)
        if B_ALIGNED:  # a multiple of the tile: whole tiles in or out, so the output masks are per row
            out_features = tl.multiple_of(out_features, BLOCK_N)
        scale = tl.load(scales_ptr + slot * stride_scales + module)
        table = page_tables_ptr + slot * stride_table
        if module == 0:
            out_rows = out0_ptr + tokens * stride_out0
        elif module == 1:
            out_rows = out1_ptr + tokens * stride_out1
        else:
            out_rows = out2_ptr + tokens * stride_out2
        num_col_tiles = tl.cdiv(out_features, BLOCK_N)
        for r in range(0, rank, BLOCK_R):
            ranks = r + tl.arange(0, BLOCK_R)  # [BLOCK_R]
            rank_mask = ranks < rank
            a_rows = a_offset + (column + ranks) * in_features  # [BLOCK_R], where each A row starts
            b_rows = b_offset + ranks * out_features  # [BLOCK_R], each B^T row
            v = tl.zeros((BLOCK_T, BLOCK_R), tl.float32)
            for k in range(0, in_features, BLOCK_K):
                cols = k + tl.arange(0, BLOCK_K)  # [BLOCK_K]
                col_mask = cols < in_features
                x = tl.load(
                    x_ptr + tokens[:, None] * stride_x + cols[None, :],
                    mask=token_mask[:, None] & col_mask[None, :],
                    other=0.0,
                )  # [BLOCK_T, BLOCK_K]
                a = _load_weight_tiles(
                    weights_ptr, table, a_rows, k, in_features, rank_mask, BLOCK_K, PAGE_ELEMS, A_ALIGNED
                )  # [BLOCK_R, BLOCK_K]
                v = _dot(x, tl.trans(a), v, PRECISION, DOT_FP32)  # [BLOCK_T, BLOCK_R]
            v_low = (v * scale).to(x_ptr.dtype.element_ty)
            for tile in range(split, num_col_tiles, N_SPLIT):
                outs = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
                out_mask = token_mask[:, None] & (outs < out_features)[None, :]
                b = _load_weight_tiles(
                    weights_ptr, table, b_rows, tile * BLOCK_N, out_features, rank_mask, BLOCK_N, PAGE_ELEMS, B_ALIGNED
                )  # [BLOCK_R, BLOCK_N]
                delta = _dot(v_low, b, tl.zeros((BLOCK_T, BLOCK_N), tl.float32), PRECISION, DOT_FP32)
                out_ptrs = out_rows[:, None] + outs[None, :]  # [BLOCK_T, BLOCK_N]
                old = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
                tl.store(out_ptrs, (old + delta).to(out0_ptr.dtype.element_ty), mask=out_mask)


def num_splits(outputs: tuple[torch.Tensor, ...]) -> int:
    """Programs per (token, module): one per column tile of the widest output, at most MAX_SPLIT."""
    return min(MAX_SPLIT, triton.cdiv(max(out.shape[1] for out in outputs), BLOCK_N))


def lora_slots(
    x: torch.Tensor,  # [num_tokens, in_features]
    outputs: tuple[torch.Tensor, ...],  # 1-3 of [num_tokens, out_features_m], updated in place
    weights: torch.Tensor,  # [num_pages, page_elems]
    token_slots: torch.Tensor,  # [num_tokens] int64
    page_tables: torch.Tensor,  # [num_slots, max_pages] int64
    meta: torch.Tensor,  # [num_slots, 14] int64
    scales: torch.Tensor,  # [num_slots, num_modules] float32
    grouping: SlotGrouping | None = None,
    gather_elements: bool = False,
) -> None:
    """Add each token's adapter delta to ``outputs`` (see the module docstring).
    ``gather_elements``: load element by element even where the tiles are aligned (to compare)."""
    check_arguments("lora_slots", x, outputs, weights, page_tables)
    num_tokens, num_slots = x.shape[0], page_tables.shape[0]
    if num_tokens == 0:
        return
    check_range("lora_slots token_slots", token_slots, -1, num_slots)
    grouping = grouping if grouping is not None else sort_by_slot(token_slots, num_slots)
    # Triton's interpreter (3.9) multiplies 16-bit dots wrongly: there they run in float32.
    dot_fp32 = x.dtype != torch.float32 and runs_interpreted()
    split = num_splits(outputs)
    block_k = shrink_width(x.shape[1], weights.shape[1], SHRINK_WIDTHS)
    a_aligned, b_aligned = alignment("lora_slots", x, outputs, weights.shape[1], meta, (block_k, BLOCK_N))
    a_aligned, b_aligned = a_aligned and not gather_elements, b_aligned and not gather_elements
    padded = (*outputs, *(outputs[0],) * (3 - len(outputs)))  # absent modules: no program runs them
    grid = (triton.cdiv(num_tokens, BLOCK_T) + min(num_tokens, num_slots), len(outputs) * split)
    _lora_slots_kernel[grid](
        x,
        padded[0],
        padded[1],
        padded[2],
        weights,
        grouping.order,
        grouping.starts,
        grouping.tile_ends,
        page_tables,
        meta,
        scales,
        num_slots,
        x.shape[1],
        x.stride(0),
        padded[0].stride(0),
        padded[1].stride(0),
        padded[2].stride(0),
        page_tables.stride(0),
        meta.stride(0),
        scales.stride(0),
        PAGE_ELEMS=weights.shape[1],
        N_SPLIT=split,
        BLOCK_T=BLOCK_T,
        BLOCK_R=BLOCK_R,
        BLOCK_K=block_k,
        BLOCK_N=BLOCK_N,
        PRECISION="ieee" if x.dtype == torch.float32 or dot_fp32 else "tf32",
        DOT_FP32=dot_fp32,
        A_ALIGNED=a_aligned,
        B_ALIGNED=b_aligned,
    )
