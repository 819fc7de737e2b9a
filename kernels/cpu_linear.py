"""loraserve's bfloat16 linear layers, from the compiled CPU kernels (``cpu.load_extension``):
``linear_dot`` and ``linear_amx`` on the weights as nn.Linear stores them (no packed copy),
``linear_pair_panels`` on a packed copy (``pack_pair_panels``). All compute

    out_i[m, n] = bf16( sum_k x[m, k] * W_i[n, k]  (+ b_i[n]) )

with the products of bfloat16 pairs exact, the sums float32 and each output rounded once to
nearest even; they differ in how they reach the weights, so the measured GEMM choice
(``loraserve/models/gemm_choice.py``) times them where the CPU has them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraserve.kernels import cpu


def _call(
    name: str, x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    module = cpu.load_extension()
    assert module is not None, f"{name} needs the compiled CPU kernels"
    outputs: list[torch.Tensor] = getattr(module, name)(x.contiguous(), weights, biases)
    return outputs


def linear_dot(
    x: torch.Tensor,  # [num_rows, in_features] bfloat16
    weights: list[torch.Tensor],  # each [out_i, in_features] bfloat16, as nn.Linear stores it
    biases: list[torch.Tensor | None],  # each [out_i] bfloat16 or None
) -> list[torch.Tensor]:  # each [num_rows, out_i] bfloat16
    """By AVX512-BF16 dot products, tiles of 4 weight rows by up to 4 rows of x
    (kernels/csrc/linear_dot.cpp). Built where the CPU has avx512_bf16 (``linear_dot_available``)."""
    return _call("linear_dot", x, weights, biases)


def linear_dot_available() -> bool:
    """Whether this build has ``linear_dot`` (its target has avx512_bf16)."""
    module = cpu.load_extension()
    return module is not None and bool(module.linear_dot_available())


def linear_amx(
    x: torch.Tensor,  # [num_rows, in_features] bfloat16
    weights: list[torch.Tensor],  # each [out_i, in_features] bfloat16, as nn.Linear stores it
    biases: list[torch.Tensor | None],  # each [out_i] bfloat16 or None
) -> list[torch.Tensor]:  # each [num_rows, out_i] bfloat16
    """On AMX tiles: 16 weight rows x 32 terms load in place as a tile, x is transposed once into
    bfloat16 pairs, and each work item of 32 weight rows serves every row of x, so the weights are
    read from memory once (kernels/csrc/linear_amx.cpp). bfloat16 denormals count as zero in the
    tiles. Built where the CPU has amx_bf16 and avx512_bf16, used where the OS grants the tile
    state (``linear_amx_available``)."""
    return _call("linear_amx", x, weights, biases)


def linear_amx_available() -> bool:
    """Whether this build has ``linear_amx`` and the OS granted the AMX tile state."""
    module = cpu.load_extension()
    return module is not None and bool(module.linear_amx_available())


def pack_pair_panels(
    weights: list[torch.Tensor],  # each [out_i, in_features] bfloat16
    biases: list[torch.Tensor | None] | None = None,  # each [out_i] or None
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [num_panels, ceil(in / 2), 32] bf16, [num_panels * 16] f32
    """The panels of ``linear_pair_panels``: ``cpu.pack_panels``' panels with each two k rows
    interleaved, ``panels[p, q, 2 j + h] = W[16 p + j, 2 q + h]`` (zero past a weight's rows or
    ``in_features``), and its padded bias widened to float32 (None when no layer has one)."""
    panels, bias = cpu.pack_panels(weights, biases)  # [num_panels, in_features, 16], [num_panels * 16]
    if panels.shape[1] % 2:
        panels = F.pad(panels, (0, 0, 0, 1))  # a zero k row: [num_panels, in_features + 1, 16]
    num_panels, _, width = panels.shape
    pairs = panels.view(num_panels, -1, 2, width).transpose(2, 3)  # [num_panels, pairs, 16, 2]
    return pairs.reshape(num_panels, -1, 2 * width).contiguous(), None if bias is None else bias.float()


def linear_pair_panels(
    x: torch.Tensor,  # [num_rows, in_features] bfloat16
    panels: torch.Tensor,  # [num_panels, ceil(in_features / 2), 32] bfloat16 from pack_pair_panels
    bias: torch.Tensor | None,  # [num_panels * 16] float32 from pack_pair_panels
    out_sizes: list[int],
) -> list[torch.Tensor]:  # each [num_rows, out_i] bfloat16, contiguous
    """The float32 panel GEMM's tiling (``cpu.linear_panels``) with a k pair for each k: tiles of
    6 rows by four panels of 16 columns, each step one AVX512-BF16 dot product (two k terms) per
    row and panel, the bias starting the sums (kernels/csrc/linear_pair_panels.cpp). Made for the
    tens of rows of a decode step, where the weights are read once per block of 144 rows. Built
    where the CPU has avx512_bf16 (``linear_pair_panels_available``)."""
    module = cpu.load_extension()
    assert module is not None, "linear_pair_panels needs the compiled CPU kernels"
    outputs: list[torch.Tensor] = module.linear_pair_panels(x.contiguous(), panels, bias, out_sizes)
    return outputs


def linear_pair_panels_silu(
    x: torch.Tensor,  # [num_rows, in_features] bfloat16
    panels: torch.Tensor,  # [2 * ceil(width / 16), ceil(in / 2), 32] bf16: pack_pair_panels([W_gate, W_up])
    bias: torch.Tensor | None,  # [num_panels * 16] float32 from pack_pair_panels
    width: int,  # out_features of the gate and of the up
) -> torch.Tensor:  # [num_rows, width] bfloat16
    """``silu(gate) * up`` of a gated pair in the epilogue of ``linear_pair_panels``' tiles:

        out[m, n] = bf16( bf16(silu(gate[m, n])) * up[m, n] )

    with ``gate, up = linear_pair_panels(x, panels, bias, [width, width])``, bit for bit what that
    call followed by ``cpu.silu_and_mul_(gate, up)`` gives, without writing and reading ``up``.
    Each tile holds a gate panel and its up panel (kernels/csrc/linear_pair_panels.cpp). Built
    where ``linear_pair_panels`` is."""
    module = cpu.load_extension()
    assert module is not None, "linear_pair_panels_silu needs the compiled CPU kernels"
    output: torch.Tensor = module.linear_pair_panels_silu(x.contiguous(), panels, bias, width)
    return output


def linear_pair_panels_available() -> bool:
    """Whether this build has ``linear_pair_panels`` (its target has avx512_bf16)."""
    module = cpu.load_extension()
    return module is not None and bool(module.linear_pair_panels_available())
