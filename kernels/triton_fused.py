"""Fused elementwise Triton kernels of a decoder layer: residual add + RMSNorm, SiLU-and-mul (RoPE
+ KV-cache write: ``triton_rope_kv.py``). Each replaces several torch ops (and their round trips
through memory) with one pass; all arithmetic is in float32, results are stored in the tensors'
dtypes.

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


def num_warps_for(elements: int) -> int:
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
        num_warps=num_warps_for(block),
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
        num_warps=num_warps_for(block),
    )
