"""Paged decode attention as a Triton kernel (the GPU path of ``paged_attention.py``).

Semantics, identical to ``paged_attention.paged_decode_attention`` (the reference): for
sequence ``s`` with ``n_s = context_lens[s]`` tokens cached (the new one included) and
query head ``h`` of KV head ``g = h // G`` (``G = num_heads / num_kv_heads``),

    out[s, h] = softmax_j( q[s, h] . K_s[j, g] * scale ) @ V_s[:, g],   j < n_s,
    K_s[j] = kv[block_tables[s, j // B], 0, j % B]   (V likewise with index 1)

Arguments (any float dtype; accumulation in float32):

* ``query``        ``[num_seqs, num_heads, head_dim]``
* ``kv``           ``[num_pages, 2, block_size, num_kv_heads, head_dim]``, one layer's pages
* ``block_tables`` ``[num_seqs, max_blocks]`` int64, entries past ``ceil(n_s / B)`` ignored
* ``context_lens`` ``[num_seqs]`` int64, each >= 1
* returns          ``[num_seqs, num_heads, head_dim]`` in ``query.dtype``

One program per (sequence, KV head) walks the sequence's context once, ``BLOCK_N`` tokens
(several pages) at a time, keeping an online softmax for the ``G`` query heads that share
the KV head: each K/V page is read once per KV head (GQA costs no extra memory traffic), and
both products are ``tl.dot`` s (the ``G`` query rows padded to 16). Float32 runs the dots in
IEEE precision; lower precisions multiply the probabilities in the input dtype, as flash
attention does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # context tokens per step of the online softmax, across as many pages as they need


@triton.jit
def _paged_decode_kernel(
    query_ptr,
    kv_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    stride_query_seq,
    stride_query_head,
    stride_kv_page,
    stride_kv_kind,
    stride_kv_slot,
    stride_kv_head,
    stride_table_seq,
    stride_out_seq,
    stride_out_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    group_index = tl.arange(0, GROUP_PAD)  # [GROUP_PAD]
    heads = kv_head * GROUP + group_index
    head_mask = group_index < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    dim_mask = dims < HEAD_DIM
    query = tl.load(
        query_ptr + seq * stride_query_seq + heads[:, None] * stride_query_head + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [GROUP_PAD, HEAD_DIM_PAD]
    if DOT_FP32:
        query = query.to(tl.float32)
    context_len = tl.load(context_lens_ptr + seq)
    table = block_tables_ptr + seq * stride_table_seq
    tile = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    running_max = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    running_sum = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM_PAD), tl.float32)
    for first in range(0, context_len, BLOCK_N):
        # Each token of the tile finds its own page: a tile spans several pages in any order.
        positions = first + tile
        valid = positions < context_len
        pages = tl.load(table + positions // BLOCK_SIZE, mask=valid, other=0)  # [BLOCK_N]
        rows = pages * stride_kv_page + (positions % BLOCK_SIZE) * stride_kv_slot + kv_head * stride_kv_head
        load_mask = valid[:, None] & dim_mask[None, :]
        key = tl.load(kv_ptr + rows[:, None] + dims[None, :], mask=load_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        value = tl.load(kv_ptr + stride_kv_kind + rows[:, None] + dims[None, :], mask=load_mask, other=0.0)
        if DOT_FP32:
            key, value = key.to(tl.float32), value.to(tl.float32)
        scores = tl.dot(query, tl.trans(key), input_precision=PRECISION) * scale  # [GROUP_PAD, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # [GROUP_PAD]
        correction = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])  # [GROUP_PAD, BLOCK_N]
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs.to(value.dtype), value, input_precision=PRECISION)
        running_max = new_max
    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_mask[:, None] & dim_mask[None, :],
    )


def runs_interpreted() -> bool:
    """Whether these kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_paged_decode_kernel, InterpretedFunction)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    context_lens: torch.Tensor,  # [num_seqs] int64
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of one query token per sequence over its paged context (see the module docstring)."""
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv.shape
    if kv.stride(4) != 1 or query.stride(2) != 1:
        raise ValueError("paged_decode_attention needs the head dimension contiguous in query and kv")
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_tables = block_tables.contiguous()
    # Triton's interpreter (3.9) multiplies 16-bit dots wrongly: there they run in float32.
    interpreted = runs_interpreted() and query.dtype != torch.float32
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        query,
        kv,
        block_tables,
        context_lens,
        out,
        scale,
        query.stride(0),
        query.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot takes at least 16 rows
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N,
        PRECISION="ieee" if query.dtype == torch.float32 or interpreted else "tf32",
        DOT_FP32=interpreted,
    )
    return out
