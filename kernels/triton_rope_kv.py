"""RoPE and the KV-cache write as one Triton kernel: for every token of a step, its query and key
heads rotated in place and its key and value stored in their page slots. All arithmetic is in
float32; results are stored in the tensors' dtypes.

``rope_write_kv`` (``apply_rope`` on query and key, then ``paged_attention.write_kv``): with
``d = head_dim / 2`` and ``c, s = cos[t], sin[t]`` (Hugging Face's rotate-half layout),

    y[t, h, i]     = x[t, h, i] * c[i]         - x[t, h, i + d] * s[i]        i < d
    y[t, h, i + d] = x[t, h, i + d] * c[i + d] + x[t, h, i] * s[i + d]
    query <- y(query), key <- y(key)                                          in place, every row
    kv[p, 0, o] = key[t], kv[p, 1, o] = value[t],  p, o = slot[t] // B, slot[t] % B   if slot[t] >= 0

* ``query``        ``[num_tokens, num_heads, head_dim]`` float, last stride 1, any token/head strides
* ``key``, ``value`` ``[num_tokens, num_kv_heads, head_dim]`` ``query.dtype``, last stride 1
* ``cos``, ``sin`` ``[num_tokens, head_dim]`` float, last stride 1
* ``kv``           ``[num_pages, 2, block_size, num_kv_heads, head_dim]`` one layer's pages, last stride 1
* ``slot_mapping`` ``[num_tokens]`` int64, ``page * block_size + offset``; -1: rotate, do not store

One program per token rotates all its query and key heads as ``[heads, head_dim / 2]`` tiles
(the two halves kept apart, so nothing is gathered or shuffled) and stores its K and V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from loraserve.kernels.page_checks import check_range
from loraserve.kernels.triton_fused import num_warps_for


@triton.jit
def _rope_heads(
    row_ptr,
    stride_head,
    cos_lo,
    cos_hi,
    sin_lo,
    sin_hi,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Rotate one token's heads in place; returns the two rotated halves, rounded to the dtype."""
    heads = tl.arange(0, HEADS_PAD)  # [HEADS_PAD]
    dims = tl.arange(0, HALF_PAD)  # [HALF_PAD]
    mask = (heads < NUM_HEADS)[:, None] & (dims < HALF)[None, :]
    lo_ptrs = row_ptr + heads[:, None] * stride_head + dims[None, :]  # [HEADS_PAD, HALF_PAD]
    lo = tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF_PAD]
    hi = tl.load(lo_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF_PAD]
    new_lo = (lo * cos_lo[None, :] - hi * sin_lo[None, :]).to(row_ptr.dtype.element_ty)
    new_hi = (hi * cos_hi[None, :] + lo * sin_hi[None, :]).to(row_ptr.dtype.element_ty)
    tl.store(lo_ptrs, new_lo, mask=mask)
    tl.store(lo_ptrs + HALF, new_hi, mask=mask)
    return new_lo, new_hi


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _rope_write_kv_kernel(
    query_ptr,
    key_ptr,
    value_ptr,
    cos_ptr,
    sin_ptr,
    kv_ptr,
    slot_mapping_ptr,
    stride_slot_mapping,
    stride_query_token,
    stride_query_head,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cos_token,
    stride_sin_token,
    stride_kv_page,
    stride_kv_kind,
    stride_kv_slot,
    stride_kv_head,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)  # [HALF_PAD]
    dim_mask = dims < HALF
    cos_row = cos_ptr + token * stride_cos_token
    sin_row = sin_ptr + token * stride_sin_token
    cos_lo = tl.load(cos_row + dims, mask=dim_mask, other=0.0).to(tl.float32)  # [HALF_PAD]
    cos_hi = tl.load(cos_row + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_row + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_row + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)
    _rope_heads(
        query_ptr + token * stride_query_token,
        stride_query_head,
        cos_lo,
        cos_hi,
        sin_lo,
        sin_hi,
        NUM_HEADS,
        HEADS_PAD,
        HALF,
        HALF_PAD,
    )
    key_lo, key_hi = _rope_heads(
        key_ptr + token * stride_key_token,
        stride_key_head,
        cos_lo,
        cos_hi,
        sin_lo,
        sin_hi,
        NUM_KV_HEADS,
        KV_HEADS_PAD,
        HALF,
        HALF_PAD,
    )  # [KV_HEADS_PAD, HALF_PAD] each
    slot = tl.load(slot_mapping_ptr + token * stride_slot_mapping)
    page = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, KV_HEADS_PAD)  # [KV_HEADS_PAD]
    # Padded rows (slot -1) store no head: the mask is all false and no address is touched.
    # (A scalar condition and-ed into a tensor mask makes an int32 mask in the 3.9 interpreter.)
    stored_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads < stored_heads)[:, None] & dim_mask[None, :]  # [KV_HEADS_PAD, HALF_PAD]
    kv_lo = kv_ptr + page * stride_kv_page + offset * stride_kv_slot + heads[:, None] * stride_kv_head + dims[None, :]
    kv_dtype = kv_ptr.dtype.element_ty
    tl.store(kv_lo, key_lo.to(kv_dtype), mask=mask)
    tl.store(kv_lo + HALF, key_hi.to(kv_dtype), mask=mask)
    value_lo = value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :]
    tl.store(kv_lo + stride_kv_kind, tl.load(value_lo, mask=mask, other=0.0).to(kv_dtype), mask=mask)
    tl.store(kv_lo + stride_kv_kind + HALF, tl.load(value_lo + HALF, mask=mask, other=0.0).to(kv_dtype), mask=mask)


def rope_write_kv(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim]
    sin: torch.Tensor,  # [num_tokens, head_dim]
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1: do not store
) -> None:
    """Rotate query and key in place and store key and value in their slots (see the module docstring)."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv.shape
    if head_dim % 2:
        raise ValueError(f"rope_write_kv needs an even head_dim, got {head_dim}")
    check_range("rope_write_kv slot_mapping", slot_mapping, -1, kv.shape[0] * kv.shape[2])
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape or kv.shape[4] != head_dim:
        raise ValueError(
            f"rope_write_kv: key {tuple(key.shape)} and value {tuple(value.shape)} must be "
            f"[{num_tokens}, {num_kv_heads}, {head_dim}] to match query and kv {tuple(kv.shape)}"
        )
    if cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError("rope_write_kv: cos and sin must be [num_tokens, head_dim], slot_mapping [num_tokens]")
    if any(t.stride(-1) != 1 for t in (query, key, value, cos, sin, kv)):
        raise ValueError("rope_write_kv needs the head dimension contiguous in query, key, value, cos, sin and kv")
    if num_tokens == 0:
        return
    half = head_dim // 2
    heads_pad = triton.next_power_of_2(num_heads)
    half_pad = triton.next_power_of_2(half)
    _rope_write_kv_kernel[(num_tokens,)](
        query,
        key,
        value,
        cos,
        sin,
        kv,
        slot_mapping,
        slot_mapping.stride(0),
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos.stride(0),
        sin.stride(0),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        NUM_HEADS=num_heads,
        HEADS_PAD=heads_pad,
        NUM_KV_HEADS=num_kv_heads,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_PAD=half_pad,
        BLOCK_SIZE=block_size,
        num_warps=num_warps_for(heads_pad * half_pad),
    )
