"""Whether a gated MLP's SiLU-and-mul runs in its GEMM's epilogue, timed with the kernel choice.

A gated MLP (a module's ``gated_groups``: Llama's gate/up) computes
``act = silu(x @ W_gate^T) * (x @ W_up^T)`` ``[rows, intermediate]``. After the GEMMs, both outputs
are written (``[rows, 2 * intermediate]``) and read back by one more pass (``kernels/cpu.py:
silu_and_mul_``). In an epilogue (``PackedLinearGroup.run_silu_and_mul``) the pair is combined
before anything is written: half the bytes written, and no pass. The bfloat16 ``panels`` do it in
their tiles (each holds a panel of the gate and of the up); oneDNN (``onednn``, ``torch``) applies
SiLU to the gate's sums and multiplies the up's by them (post-ops).

Which way is faster depends on the CPU, the dtype, the kernel and the row count, and it moves the
kernel choice (a kernel whose epilogue saves the pass can beat one that is faster on the GEMM
alone), so a gated shape's kernels are timed on the whole of ``act``: each kernel with the pass,
and each that has an epilogue with it, on the model's own weights in every row bucket
(``time_gated``); a kernel counts with its epilogue where that was clearly faster (``pick_gated``),
and ``models/gemm_choice.py`` chooses among those times. A step whose adapters add LoRA to gate or
up needs the two outputs, so it takes them whatever was chosen.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.kernels import cpu
from loraserve.models.cpu_load import best_alternating_passes
from loraserve.models.packed_linear import GemmKernel, PackedLinearGroup, silu_epilogue_kernels

TIE_TOLERANCE = 0.03  # the epilogue must be this much faster to be chosen (noise between passes)


def time_gated(
    instances: Sequence[Sequence[nn.Linear]], rows: Sequence[int], kernels: Sequence[GemmKernel]
) -> tuple[dict[GemmKernel, list[float]], dict[GemmKernel, list[float]]]:
    """``(with_pass, with_epilogue)``: per kernel of ``kernels`` and row count of ``rows``, the
    seconds of one pass over ``instances`` (gated pairs of one shape) computing ``silu(gate) * up``,
    the GEMM followed by the SiLU pass, and in the kernel's epilogue (only the kernels that have one
    for this dtype), the best of several passes, all ways alternating."""
    first = instances[0]
    dtype = first[0].weight.dtype
    fused = [k for k in kernels if k in silu_epilogue_kernels(dtype)]
    gen = torch.Generator().manual_seed(0)
    with_pass: dict[GemmKernel, list[float]] = {k: [] for k in kernels}
    with_epilogue: dict[GemmKernel, list[float]] = {k: [] for k in fused}
    with torch.no_grad():
        groups = {k: [PackedLinearGroup(pair, (k,)) for pair in instances] for k in kernels}
        for count in rows:
            x = torch.randn(count, first[0].in_features, generator=gen).to(dtype)  # [count, in_features]
            passes = {(k, False): functools.partial(_one_pass, groups[k], k, x, False) for k in kernels}
            passes |= {(k, True): functools.partial(_one_pass, groups[k], k, x, True) for k in fused}
            best = best_alternating_passes(passes)
            for (kernel, epilogue), seconds in best.items():
                (with_epilogue if epilogue else with_pass)[kernel].append(seconds)
    return with_pass, with_epilogue


def pick_gated(
    with_pass: dict[GemmKernel, list[float]], with_epilogue: dict[GemmKernel, list[float]]
) -> tuple[dict[GemmKernel, list[float]], dict[GemmKernel, tuple[bool, ...]]]:
    """Per kernel: its time in each bucket (with the epilogue where that was more than a tie faster
    than with the pass) and in which buckets that was."""
    times: dict[GemmKernel, list[float]] = {}
    epilogue: dict[GemmKernel, tuple[bool, ...]] = {}
    for kernel, passed in with_pass.items():
        fused = with_epilogue.get(kernel, [float("inf")] * len(passed))
        epilogue[kernel] = tuple(f < p * (1 - TIE_TOLERANCE) for p, f in zip(passed, fused, strict=True))
        times[kernel] = [f if on else p for p, f, on in zip(passed, fused, epilogue[kernel], strict=True)]
    return times, epilogue


def silu_and_mul_pass(gate: torch.Tensor, up: torch.Tensor) -> None:
    """``gate <- silu(gate) * up`` as the model's CPU kernels do it (``[rows, width]`` each)."""
    if cpu.load_extension() is not None:
        cpu.silu_and_mul_(gate, up)
    else:
        F.silu(gate, inplace=True).mul_(up)


def _one_pass(groups: list[PackedLinearGroup], kernel: GemmKernel, x: torch.Tensor, epilogue: bool) -> float:
    start = time.perf_counter()
    for group in groups:
        if epilogue:
            group.run_silu_and_mul(kernel, x)
        else:
            gate, up = group.run(kernel, x)
            silu_and_mul_pass(gate, up)
    return time.perf_counter() - start
