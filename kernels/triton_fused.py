"""Fused elementwise Triton kernels of a decoder layer: residual add + RMSNorm, SiLU-and-mul,
RoPE + KV-cache write. Each replaces several torch ops (and their round trips through memory)
with one pass; all arithmetic is in float32, results are stored in the tensors' dtypes.

``fused_add_rms_norm`` (the model's ``RMSNorm.forward``, ``models/llama.py``): for token ``t``,

    r[t]   = round(residual[t] + x[t])        stored back into residual (only with a residual)
    h[t]   = r[t]  (or x[t] without a residual), in float32
    out[t] = weight * round(h[t] * rsqrt(mean_i(h[t, i]^2) + eps))

(``round``: to the input dtype, a no-op in float32).

* ``x``        ``[num_tokens, hidden]`` any float dtype, last stride 1
* ``weight``   ``[hidden]`` float, contiguous
* ``residual`` ``[num_tokens, hidden]`` ``x.dtype``, last stride 1, or None; updated in place
* returns      ``[num_tokens, hidden]``, new and contiguous, in ``promote(weight.dtype, x.dtype)``

One program per token row: the row is one tile when ``hidden <= RMS_NORM_MAX_BLOCK``, else
two passes over ``RMS_NORM_MAX_BLOCK`` chunks (sum of squares, then scale).

``silu_and_mul`` (``F.silu(gate, inplace=True).mul_(up)``, without rounding the SiLU):

    gate[t, j] = round(silu(gate[t, j]) * up[t, j]),   silu(g) = g / (1 + exp(-g))

* ``gate``, ``up`` ``[num_tokens, intermediate]`` one float dtype, last stride 1, any row stride
  (the two column halves of one ``[num_tokens, 2 * intermediate]`` projection); gate updated in place

Grid: (token, column tile of ``SILU_BLOCK``).

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

RMS_NORM_MAX_BLOCK = 8192  # widest row kept in one tile; wider rows take two passes of this many columns
SILU_BLOCK = 1024  # columns per program of silu_and_mul


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    hidden,
    eps,
    stride_x,
    stride_residual,
    stride_out,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    residual_row = residual_ptr + row * stride_residual
    out_row = out_ptr + row * stride_out
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    if ONE_BLOCK:
        mask = cols < hidden
        h = tl.load(x_row + cols, mask=mask, other=0.0)  # [BLOCK]
        if HAS_RESIDUAL:
            h = (h.to(tl.float32) + tl.load(residual_row + cols, mask=mask, other=0.0).to(tl.float32)).to(
                residual_ptr.dtype.element_ty
            )
            tl.store(residual_row + cols, h, mask=mask)
        h = h.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
        normed = (h * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Pass 1: the sum of squares (and the residual sum, stored rounded as the reference does).
        squares = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, hidden, BLOCK):
            mask = start + cols < hidden
            h = tl.load(x_row + start + cols, mask=mask, other=0.0)  # [BLOCK]
            if HAS_RESIDUAL:
                h = (h.to(tl.float32) + tl.load(residual_row + start + cols, mask=mask, other=0.0).to(tl.float32)).to(
                    residual_ptr.dtype.element_ty
                )
                tl.store(residual_row + start + cols, h, mask=mask)
            h = h.to(tl.float32)
            squares += h * h
        inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / hidden + eps)
        # Pass 2: scale the (summed) row, read back; each thread reads the columns it wrote.
        for start in range(0, hidden, BLOCK):
            mask = start + cols < hidden
            if HAS_RESIDUAL:
                h = tl.load(residual_row + start + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
            else:
                h = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            normed = (h * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
            weight = tl.load(weight_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + start + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    gate_ptr,
    up_ptr,
    width,
    stride_gate,
    stride_up,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < width
    gate_row = gate_ptr + row * stride_gate
    gate = tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(gate_row + cols, out.to(gate_ptr.dtype.element_ty), mask=mask)


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


def _num_warps(elements: int) -> int:
    """Warps for a tile of ``elements``: about 8 elements a thread, 1 to 16 warps."""
    return min(16, max(1, elements // 256))


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden], updated in place
) -> torch.Tensor:  # [num_tokens, hidden]
    """RMSNorm of ``x`` (with ``residual``: of ``residual += x``, stored in place); see the module docstring."""
    num_tokens, hidden = x.shape
    if x.stride(1) != 1 or weight.stride(0) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("fused_add_rms_norm needs the hidden dimension contiguous in x, residual and weight")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    out = torch.empty(num_tokens, hidden, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if num_tokens == 0:
        return out
    block = min(triton.next_power_of_2(hidden), RMS_NORM_MAX_BLOCK)
    _rms_norm_kernel[(num_tokens,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        hidden,
        eps,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        ONE_BLOCK=hidden <= block,
        num_warps=_num_warps(block),
    )
    return out


def silu_and_mul(
    gate: torch.Tensor,  # [num_tokens, intermediate], updated in place
    up: torch.Tensor,  # [num_tokens, intermediate]
) -> None:
    """``gate <- silu(gate) * up`` in place, in float32 (see the module docstring)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    if gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError("silu_and_mul needs the columns contiguous in gate and up")
    num_tokens, width = gate.shape
    if num_tokens == 0 or width == 0:
        return
    block = min(triton.next_power_of_2(width), SILU_BLOCK)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, block))](
        gate,
        up,
        width,
        gate.stride(0),
        up.stride(0),
        BLOCK=block,
        num_warps=_num_warps(block),
    )


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
        num_warps=_num_warps(heads_pad * half_pad),
    )
