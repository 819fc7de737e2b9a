"""What both Triton LoRA kernels share (``triton_lora.py``: by segment, ``triton_lora_slots.py``:
by adapter slot): the segment metadata's columns as kernel constants, the load of a weight tile
through an adapter's page table, the dot in the kernels' precision, a shrink's loop over input
columns, a module's metadata and the scaled add into its output, and on the host the checks of
their arguments, which tiles may be loaded as aligned runs, and the launches' settings."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from loraserve.kernels import page_checks
from loraserve.kernels.lora import WEIGHT_ALIGN, SegmentMeta
from loraserve.kernels.page_checks import check_multiples, check_range
from loraserve.kernels.triton_unified_attention import runs_interpreted

# The segment metadata layout (kernels/lora.py: SegmentMeta), as constants the kernels can read.
META_A_OFFSET = tl.constexpr(SegmentMeta.A_OFFSET)
META_NUM_ROWS = tl.constexpr(SegmentMeta.NUM_ROWS)
META_MODULE_BASE = tl.constexpr(SegmentMeta.MODULE_BASE)
META_MODULE_STRIDE = tl.constexpr(SegmentMeta.MODULE_STRIDE)
META_COLUMN = tl.constexpr(SegmentMeta.COLUMN)
META_RANK = tl.constexpr(SegmentMeta.RANK)
META_B_OFFSET = tl.constexpr(SegmentMeta.B_OFFSET)
META_OUT_FEATURES = tl.constexpr(SegmentMeta.OUT_FEATURES)
ALIGN = tl.constexpr(WEIGHT_ALIGN)


@triton.jit
def _load_weight_tiles(
    weights_ptr,
    table,
    row_starts,
    first_col,
    row_length,
    row_mask,
    WIDTH: tl.constexpr,
    PAGE_ELEMS: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """``[R, WIDTH]``: columns ``first_col ..`` of ``R`` rows (row ``i`` starts at element
    ``row_starts[i]`` of an adapter's flat layer buffer), found through its page table; zeros past
    the row or for masked rows. ``ALIGNED`` (the caller's guarantee, ``aligned_tiles``): each run
    of ``min(WIDTH, WEIGHT_ALIGN)`` columns lies inside one page, so one page id per row and run
    and contiguous, vectorised loads, all of a tile's runs issued at once; otherwise the page of
    every element (``weights[page_table[e // page_elems], e % page_elems]``)."""
    if ALIGNED and WIDTH <= ALIGN:
        starts = row_starts + first_col  # [R]
        pages = tl.load(table + starts // PAGE_ELEMS, mask=row_mask, other=0)  # [R]
        bases = tl.multiple_of(pages * PAGE_ELEMS + starts % PAGE_ELEMS, WIDTH)  # [R]
        ptrs = weights_ptr + bases[:, None] + tl.arange(0, WIDTH)[None, :]  # [R, WIDTH]
        return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    elif ALIGNED:  # runs of ALIGN columns, each in one page
        starts = row_starts[:, None] + first_col + ALIGN * tl.arange(0, WIDTH // ALIGN)[None, :]  # [R, C]
        pages = tl.load(table + starts // PAGE_ELEMS, mask=row_mask[:, None], other=0)  # [R, C]
        bases = tl.multiple_of(pages * PAGE_ELEMS + starts % PAGE_ELEMS, [ALIGN, ALIGN])  # [R, C]
        ptrs = weights_ptr + bases[:, :, None] + tl.arange(0, ALIGN)[None, None, :]  # [R, C, ALIGN]
        runs = tl.load(ptrs, mask=row_mask[:, None, None], other=0.0)  # [R, C, ALIGN]
        return tl.reshape(runs, (row_starts.shape[0], WIDTH))
    else:
        cols = first_col + tl.arange(0, WIDTH)  # [WIDTH]
        elems = row_starts[:, None] + cols[None, :]  # [R, WIDTH]
        mask = row_mask[:, None] & (cols < row_length)[None, :]
        pages = tl.load(table + elems // PAGE_ELEMS, mask=mask, other=0)
        return tl.load(weights_ptr + pages * PAGE_ELEMS + elems % PAGE_ELEMS, mask=mask, other=0.0)


@triton.jit
def _dot(lhs, rhs, acc, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        lhs, rhs = lhs.to(tl.float32), rhs.to(tl.float32)
    return tl.dot(lhs, rhs, acc, input_precision=PRECISION)


@triton.jit
def _shrink_tile(
    x_ptr,
    stride_x,
    tokens,
    token_mask,
    weights_ptr,
    table,
    row_starts,
    row_mask,
    k_begin,
    k_end,
    in_features,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PAGE_ELEMS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """``[BLOCK_T, BLOCK_R]`` float32: ``x[tokens, k_begin:k_end] @ A[rows, k_begin:k_end]^T``, the
    A rows starting at ``row_starts`` of the adapter's flat buffer (found through ``table``), in
    steps of ``BLOCK_K`` columns; masked tokens and rows give zeros."""
    acc = tl.zeros((BLOCK_T, BLOCK_R), tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        x = tl.load(
            x_ptr + tokens[:, None] * stride_x + cols[None, :],
            mask=token_mask[:, None] & (cols < in_features)[None, :],
            other=0.0,
        )  # [BLOCK_T, BLOCK_K]
        a = _load_weight_tiles(
            weights_ptr, table, row_starts, k, in_features, row_mask, BLOCK_K, PAGE_ELEMS, ALIGNED
        )  # [BLOCK_R, BLOCK_K]
        acc = _dot(x, tl.trans(a), acc, PRECISION, DOT_FP32)  # [BLOCK_T, BLOCK_R]
    return acc


@triton.jit
def _module_meta(meta_row, module, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr):
    """A module's ``column, rank, b_offset, out_features`` from its segment's (or slot's)
    metadata row; ``ALIGNED``: ``out_features`` is a multiple of the tile, so whole tiles are in or
    out and the output masks are per row."""
    module_meta = meta_row + META_MODULE_BASE + META_MODULE_STRIDE * module
    column = tl.load(module_meta + META_COLUMN)
    rank = tl.load(module_meta + META_RANK)
    b_offset = tl.load(module_meta + META_B_OFFSET)
    out_features = tl.load(module_meta + META_OUT_FEATURES)
    if ALIGNED:
        out_features = tl.multiple_of(out_features, BLOCK_N)
    return column, rank, b_offset, out_features


@triton.jit
def _add_scaled(
    out0_ptr, out1_ptr, out2_ptr, stride_out0, stride_out1, stride_out2, module, tokens, cols, out_mask, acc, scale
):
    """``out_module[tokens, cols] += scale * acc``, summed in float32, rounded once to the outputs' dtype."""
    if module == 0:
        out_ptrs = out0_ptr + tokens[:, None] * stride_out0 + cols[None, :]
    elif module == 1:
        out_ptrs = out1_ptr + tokens[:, None] * stride_out1 + cols[None, :]
    else:
        out_ptrs = out2_ptr + tokens[:, None] * stride_out2 + cols[None, :]
    old = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (old + acc * scale).to(out0_ptr.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class LaunchSettings:
    """What a LoRA kernel pair's launches take from its arguments (``launch_settings``)."""

    dot_fp32: bool  # 16-bit dots in float32 (Triton's interpreter multiplies them wrongly)
    precision: str  # tl.dot's input_precision
    page_elems: int
    block_k: int  # the shrink's input columns per step
    a_aligned: bool  # the shrink's A tiles load as aligned runs
    b_aligned: bool  # the expand's B^T tiles load as aligned runs
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # padded to 3 (absent modules never run)
    num_col_blocks: int  # the expand's column tiles of the widest output


def launch_settings(
    name: str,
    x: torch.Tensor,  # [num_tokens, in_features]
    outputs: tuple[torch.Tensor, ...],  # 1-3 of [num_tokens, out_features_m]
    weights: torch.Tensor,  # [num_pages, page_elems]
    meta: torch.Tensor,  # [S, 14] int64
    shrink_widths: tuple[int, ...],
    expand_width: int,
    gather_elements: bool,
) -> LaunchSettings:
    """The settings of a shrink and expand launch; ``gather_elements`` loads every tile element
    by element (to compare against the aligned loads)."""
    # Triton's interpreter (3.9) multiplies 16-bit dots wrongly: there they run in float32.
    dot_fp32 = x.dtype != torch.float32 and runs_interpreted()
    page_elems = weights.shape[1]
    block_k = shrink_width(x.shape[1], page_elems, shrink_widths)
    a_aligned, b_aligned = alignment(name, x, outputs, page_elems, meta, (block_k, expand_width))
    return LaunchSettings(
        dot_fp32=dot_fp32,
        precision="ieee" if x.dtype == torch.float32 or dot_fp32 else "tf32",
        page_elems=page_elems,
        block_k=block_k,
        a_aligned=a_aligned and not gather_elements,
        b_aligned=b_aligned and not gather_elements,
        outputs=(outputs[0], *outputs[1:], *(outputs[0],) * (3 - len(outputs))),  # type: ignore[arg-type]
        num_col_blocks=triton.cdiv(max(out.shape[1] for out in outputs), expand_width),
    )


def check_arguments(
    name: str, x: torch.Tensor, outputs: tuple[torch.Tensor, ...], weights: torch.Tensor, page_tables: torch.Tensor
) -> None:
    """What both LoRA kernels need: 1-3 outputs, row-major tensors, page ids inside the pool (debug mode)."""
    if not 1 <= len(outputs) <= 3:
        raise ValueError(f"{name} takes 1 to 3 outputs, got {len(outputs)}")
    if x.stride(1) != 1 or any(out.stride(1) != 1 for out in outputs) or not weights.is_contiguous():
        raise ValueError(f"{name} needs row-major x, outputs and weights")
    check_range(f"{name} page_tables", page_tables, 0, weights.shape[0])


def aligned_tiles(row_length: int, page_elems: int, width: int) -> bool:
    """Whether every ``width``-element tile at a multiple of ``width`` along a row of
    ``row_length`` elements splits into runs of ``min(width, WEIGHT_ALIGN)`` that each lie inside
    one page: ``lora/layout.py`` starts a matrix whose rows are a multiple of ``WEIGHT_ALIGN`` at a
    multiple of it, the run divides that and the page, and the tiles cover the row exactly."""
    run = min(width, WEIGHT_ALIGN)
    return (
        width % run == 0
        and WEIGHT_ALIGN % run == 0
        and row_length % WEIGHT_ALIGN == 0
        and row_length % width == 0
        and page_elems % run == 0
    )


def shrink_width(in_features: int, page_elems: int, widths: tuple[int, ...]) -> int:
    """Input columns per step of a shrink: the widest of ``widths`` whose tiles are aligned, else
    the narrowest (tiles loaded element by element). Fixed per layer group, so one compilation each."""
    return next((w for w in widths if aligned_tiles(in_features, page_elems, w)), widths[-1])


def alignment(
    name: str,
    x: torch.Tensor,  # [num_tokens, in_features]
    outputs: tuple[torch.Tensor, ...],  # 1-3 of [num_tokens, out_features_m]
    page_elems: int,
    meta: torch.Tensor,  # [S, 14] int64
    widths: tuple[int, int],
) -> tuple[bool, bool]:
    """Whether the shrink's A tiles (``widths[0]`` wide) and the expand's B^T tiles
    (``widths[1]``) may be loaded as aligned runs; in the debug mode, checks the offsets in
    ``meta [S, 14]`` that the aligned loads rely on."""
    a_aligned = aligned_tiles(x.shape[1], page_elems, widths[0])
    b_aligned = all(aligned_tiles(out.shape[1], page_elems, widths[1]) for out in outputs)
    if not page_checks.ENABLED:  # the checks' views of meta cost host time in every launch
        return a_aligned, b_aligned
    if a_aligned:
        check_multiples(f"{name} A offsets", meta[:, META_A_OFFSET.value], WEIGHT_ALIGN)
    if b_aligned:
        modules = META_MODULE_BASE.value + META_MODULE_STRIDE.value * torch.arange(len(outputs), device=meta.device)
        check_multiples(f"{name} B offsets", meta[:, modules + META_B_OFFSET.value], WEIGHT_ALIGN)
    return a_aligned, b_aligned
