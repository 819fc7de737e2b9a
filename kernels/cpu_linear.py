"""loraserve's bfloat16 linear layers on the weights as nn.Linear stores them (no packed copy),
from the compiled CPU kernels (``cpu.load_extension``). Both compute

    out_i[m, n] = bf16( sum_k x[m, k] * W_i[n, k]  (+ b_i[n]) )

with the products of bfloat16 pairs exact, the sums float32 and each output rounded once to
nearest even; they differ in how they reach the weights, so the measured GEMM choice
(``loraserve/models/gemm_choice.py``) times both where the CPU has them.
"""

from __future__ import annotations

import torch
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
