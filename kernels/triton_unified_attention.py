"""Paged attention for a whole step in one launch per layer: decode tokens, prefill chunks and
prefills over cached prefix blocks alike (vLLM v1's "unified attention" design, our own code).

Semantics, identical to ``paged_attention.paged_attention_reference`` (the torch twin: gather +
SDPA per sequence): sequence ``s`` owns query rows ``t in [qs_s, qs_{s+1})`` (``qs`` =
``query_starts``); its context holds ``n_s = seq_lens[s]`` tokens after this step's KV write, so
its ``q_s = qs_{s+1} - qs_s`` queries sit at positions ``n_s - q_s + i`` (``i`` the row's index
in the sequence), and with ``g = h // G`` (``G = num_heads / num_kv_heads``):

    out[t, h] = softmax_j( q[t, h] . K_s[j, g] * scale,  j <= n_s - q_s + i ) @ V_s[:, g]
    K_s[j]    = kv[block_tables[s, j // B], 0, j % B]          (V likewise with index 1)

A decode token is a sequence with ``q_s = 1``; a prefill over ``c`` cached tokens has
``n_s = c + q_s``. Rows of the output not covered by any sequence (``t >= qs_S``) are not written
(a new output is zero there).

Arguments (one float dtype for ``query``/``kv``/``out``; accumulation in float32):

* ``query``        ``[num_tokens, num_heads, head_dim]`` (head_dim contiguous)
* ``kv``           ``[num_pages, 2, block_size, num_kv_heads, head_dim]``, one layer's pages
* ``query_starts`` ``[num_seqs + 1]`` int64, non-decreasing, ``query_starts[0] = 0``
* ``seq_lens``     ``[num_seqs]`` int64, ``seq_lens[s] >= q_s``
* ``block_tables`` ``[num_seqs, max_blocks]`` int64, entries past ``ceil(n_s / B)`` ignored
* returns / ``out`` ``[num_tokens, num_heads, head_dim]``

A program takes ``BLOCK_Q`` query tokens of one sequence and one KV head: its ``BLOCK_M =
BLOCK_Q * G`` (padded to 16) rows are (token, query head of the group) pairs, so each K/V tile
is read once for the whole query group (GQA costs no extra traffic) and both products are
``tl.dot`` s. Programs find their sequence by binary search over ``query_starts`` (the grid is
``num_tokens // BLOCK_Q + num_seqs`` query blocks, an upper bound; programs past their
sequence's queries return), so the host computes no per-step schedule and the launch is the
same for a CUDA graph whatever the lengths. The context is walked ``BLOCK_N`` tokens (several
pages, each token finding its page) per online-softmax step, only up to the tile's last query
position (causal skipping). ``num_splits > 1`` is the split-KV (flash-decoding) path for few
sequences with long contexts: each of ``num_splits`` programs per query block walks one share
of the context and writes a partial result with its running max and sum; a second kernel merges
them by log-sum-exp. Fully masked rows (padding) are guarded against NaN.

Integer arguments whose value changes from step to step (``num_seqs``, the block table's row
stride) are not specialised by Triton (``do_not_specialize``), so no step triggers a new
compilation once each (dtype, head shape, block size, split count) has been compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraserve.kernels.page_checks import check_range

BLOCK_N = 64  # context tokens per online-softmax step, across as many pages as they need
MIN_BLOCK_M = 16  # tl.dot takes at least 16 rows


@triton.jit
def _find_sequence(query_starts_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks include global block ``q_block``: the last ``s`` with
    ``query_starts[s] // BLOCK_Q + s <= q_block`` (binary search)."""
    low = 0
    high = num_seqs
    while low < high:
        mid = (low + high) // 2
        first_block = tl.load(query_starts_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit(
    do_not_specialize=["num_seqs", "stride_table_seq"],
    do_not_specialize_on_alignment=["query_starts_ptr", "seq_lens_ptr", "block_tables_ptr"],
)
def _unified_attention_kernel(
    query_ptr,
    kv_ptr,
    query_starts_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    scale,
    num_seqs,
    stride_query_tok,
    stride_query_head,
    stride_kv_page,
    stride_kv_kind,
    stride_kv_slot,
    stride_kv_head,
    stride_table_seq,
    stride_out_tok,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_sequence(query_starts_ptr, num_seqs, q_block, BLOCK_Q)
    query_start = tl.load(query_starts_ptr + seq)
    query_len = tl.load(query_starts_ptr + seq + 1) - query_start
    local_block = q_block - (query_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_before = seq_len - query_len  # tokens cached before this step's queries

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]: (query token, head of the group) pairs
    query_index = local_block * BLOCK_Q + rows // GROUP  # [BLOCK_M], index within the sequence
    heads = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (query_index < query_len)
    tokens = query_start + query_index
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    dim_mask = dims < HEAD_DIM
    query = tl.load(
        query_ptr + tokens[:, None] * stride_query_tok + heads[:, None] * stride_query_head + dims[None, :],
        mask=row_valid[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    if DOT_FP32:
        query = query.to(tl.float32)
    query_positions = context_before + query_index  # [BLOCK_M]

    # Causal: this tile's queries see at most the context up to its last query position.
    last_query = tl.minimum(local_block * BLOCK_Q + BLOCK_Q, query_len) - 1
    context_end = context_before + last_query + 1
    num_tiles = tl.cdiv(context_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)

    table = block_tables_ptr + seq * stride_table_seq
    tile = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    running_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PAD), tl.float32)
    for tile_index in range(first_tile, last_tile):
        positions = tile_index * BLOCK_N + tile  # [BLOCK_N]
        in_context = positions < context_end
        pages = tl.load(table + positions // BLOCK_SIZE, mask=in_context, other=0)  # [BLOCK_N]
        kv_rows = pages * stride_kv_page + (positions % BLOCK_SIZE) * stride_kv_slot + kv_head * stride_kv_head
        load_mask = in_context[:, None] & dim_mask[None, :]
        key = tl.load(kv_ptr + kv_rows[:, None] + dims[None, :], mask=load_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        value = tl.load(kv_ptr + stride_kv_kind + kv_rows[:, None] + dims[None, :], mask=load_mask, other=0.0)
        if DOT_FP32:
            key, value = key.to(tl.float32), value.to(tl.float32)
        scores = tl.dot(query, tl.trans(key), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        visible = (positions[None, :] <= query_positions[:, None]) & in_context[None, :] & row_valid[:, None]
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # [BLOCK_M]
        # A row with nothing visible yet keeps max -inf: subtract 0 instead (exp(-inf) = 0, no NaN).
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp(running_max - safe_max)
        probs = tl.exp(scores - safe_max[:, None])  # [BLOCK_M, BLOCK_N]
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs.to(value.dtype), value, input_precision=PRECISION)
        running_max = new_max

    store_mask = row_valid[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        tl.store(
            out_ptr + tokens[:, None] * stride_out_tok + heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        # partial_*: [num_tokens, NUM_HEADS, NUM_SPLITS(, HEAD_DIM_PAD)], float32, unnormalised.
        stat = (tokens * NUM_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(partial_max_ptr + stat, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + stat, running_sum, mask=row_valid)
        tl.store(partial_out_ptr + stat[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_seqs"], do_not_specialize_on_alignment=["query_starts_ptr"])
def _merge_splits_kernel(
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    out_ptr,
    query_starts_ptr,
    num_seqs,
    stride_out_tok,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """``out = Σ_i e^{m_i - M} acc_i / Σ_i e^{m_i - M} l_i`` over the splits of one (token, head)."""
    token = tl.program_id(0).to(tl.int64)  # stat * HEAD_DIM_PAD passes 2**31 on long prompts
    head = tl.program_id(1)
    if token >= tl.load(query_starts_ptr + num_seqs):
        return  # a row no sequence covers (padding): left as it is
    splits = tl.arange(0, NUM_SPLITS)  # [NUM_SPLITS]
    dims = tl.arange(0, HEAD_DIM_PAD)
    stat = (token * NUM_HEADS + head) * NUM_SPLITS + splits
    maxima = tl.load(partial_max_ptr + stat)  # [NUM_SPLITS]
    sums = tl.load(partial_sum_ptr + stat)
    overall = tl.max(maxima, axis=0)
    overall = tl.where(overall == float("-inf"), 0.0, overall)
    weights = tl.exp(maxima - overall)  # [NUM_SPLITS], 0 for empty splits
    acc = tl.load(partial_out_ptr + stat[:, None] * HEAD_DIM_PAD + dims[None, :])  # [NUM_SPLITS, HEAD_DIM_PAD]
    total = tl.sum(sums * weights, axis=0)
    out = tl.sum(acc * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # [HEAD_DIM_PAD]
    tl.store(
        out_ptr + token * stride_out_tok + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def runs_interpreted() -> bool:
    """Whether loraserve's Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when
    they were imported: CPU tensors, for tests)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_unified_attention_kernel, InterpretedFunction)


def block_shape(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_Q)``: rows per program and query tokens they cover."""
    group = num_heads // num_kv_heads
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(group))
    return block_m, block_m // group


def grid_query_blocks(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int) -> int:
    """Programs along the query axis: enough for any split of ``num_tokens`` into ``num_seqs``."""
    return num_tokens // block_shape(num_heads, num_kv_heads)[1] + num_seqs


def unified_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    query_starts: torch.Tensor,  # [num_seqs + 1] int64
    seq_lens: torch.Tensor,  # [num_seqs] int64
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_splits: int = 1,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of every query row of a step over its sequence's paged context (module docstring)."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv.shape
    num_seqs = block_tables.shape[0]
    if kv.stride(4) != 1 or query.stride(2) != 1:
        raise ValueError("unified_attention needs the head dimension contiguous in query and kv")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
    if out is None:  # zeros: rows no sequence covers (a padded batch's) stay finite
        out = torch.zeros_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    check_range("unified_attention block_tables", block_tables, 0, kv.shape[0])
    check_range("unified_attention seq_lens", seq_lens, 0, block_tables.shape[1] * block_size + 1)
    block_m, block_q = block_shape(num_heads, num_kv_heads)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # Triton's interpreter (3.9) multiplies 16-bit dots wrongly: there they run in float32.
    interpreted = runs_interpreted() and query.dtype != torch.float32
    partials: tuple[torch.Tensor, ...] = (out, out, out)  # unused when num_splits == 1
    if num_splits > 1:
        stats = (num_tokens, num_heads, num_splits)
        partials = (
            torch.empty(*stats, head_dim_pad, dtype=torch.float32, device=query.device),
            torch.empty(stats, dtype=torch.float32, device=query.device),
            torch.empty(stats, dtype=torch.float32, device=query.device),
        )
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _unified_attention_kernel[grid](
        query,
        kv,
        query_starts,
        seq_lens,
        block_tables,
        out,
        *partials,
        scale,
        num_seqs,
        query.stride(0),
        query.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        GROUP=num_heads // num_kv_heads,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N,
        NUM_SPLITS=num_splits,
        PRECISION="ieee" if query.dtype == torch.float32 or interpreted else "tf32",
        DOT_FP32=interpreted,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            *partials,
            out,
            query_starts,
            num_seqs,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits,
        )
    return out
