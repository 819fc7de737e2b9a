"""Whether a gated MLP's SiLU-and-mul runs in oneDNN's GEMM epilogues, timed per row bucket.

A gated MLP (a module's ``gated_groups``: Llama's gate/up) computes
``act = silu(x @ W_gate^T) * (x @ W_up^T)`` ``[rows, intermediate]``. After the GEMMs, both outputs
are written (``[rows, 2 * intermediate]``) and read back by one more pass (``kernels/cpu.py:
silu_and_mul_``). In the epilogues (``PackedLinearGroup.run_silu_and_mul``) the gate GEMM applies
SiLU to its sums before writing them and the up GEMM multiplies its sums by that result: half the
bytes written, and no pass. Which is faster depends on the CPU, the dtype and the row count, so
both ways are timed on the model's own weights in every row bucket whose chosen GEMM kernel runs
on oneDNN (``EPILOGUE_KERNELS``), right after the GEMM choice, and cached beside it
(``gemm_cache.py``). A step whose adapters add LoRA to gate or up needs the two outputs, so it
takes them whatever was chosen.
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
from loraserve.models.packed_linear import EPILOGUE_KERNELS, GemmKernel, PackedLinearGroup, can_run_silu_epilogue

TIE_TOLERANCE = 0.03  # the epilogue must be this much faster to be chosen (noise between passes)
WAYS = ("pass", "epilogue")  # the order of the timings of a bucket


def time_silu_epilogue(
    instances: Sequence[Sequence[nn.Linear]], rows: Sequence[int], kernels: Sequence[GemmKernel]
) -> dict[int, list[float]]:
    """Per row count whose bucket's kernel (``kernels[i]`` for ``rows[i]``) can run the epilogue:
    the seconds of one pass over ``instances`` (gated pairs of one shape) for each of ``WAYS``, the
    best of several passes, the two ways alternating. Row counts that cannot: no entry."""
    first = instances[0]
    dtype = first[0].weight.dtype
    if not can_run_silu_epilogue([linear.out_features for linear in first], dtype):
        return {}
    gen = torch.Generator().manual_seed(0)
    times: dict[int, list[float]] = {}
    with torch.no_grad():
        for count, kernel in zip(rows, kernels, strict=True):
            if kernel not in EPILOGUE_KERNELS:
                continue
            groups = [PackedLinearGroup(pair, (kernel,)) for pair in instances]
            x = torch.randn(count, first[0].in_features, generator=gen).to(dtype)  # [count, in_features]
            best = best_alternating_passes(
                {way: functools.partial(_one_pass, groups, kernel, x, way == "epilogue") for way in WAYS}
            )
            times[count] = [best[way] for way in WAYS]
    return times


def pick_silu_epilogue(times: dict[int, list[float]], rows: Sequence[int]) -> tuple[bool, ...]:
    """Per row count of ``rows``: whether the epilogue was timed more than a tie faster than the pass."""
    return tuple(count in times and times[count][1] < times[count][0] * (1 - TIE_TOLERANCE) for count in rows)


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
