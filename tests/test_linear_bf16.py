"""The bfloat16 GEMM kernels, ``dot`` (kernels/csrc/linear_dot.cpp) and ``amx``
(kernels/csrc/linear_amx.cpp) on the plain weights, and ``panels`` on panels of k pairs
(kernels/csrc/linear_pair_panels.cpp), against the float64 result.

Their products of bfloat16 pairs are exact and their sums float32, and each output is rounded
once: so every output is the float64 result rounded to bfloat16, except where that result lies
within the float32 sums' error of a rounding boundary, where it may lie elsewhere within that
error (plus the rounding), and at least 95 % of them must be exact. Row counts cover partial and
whole tiles (dot: 4 rows; amx: 16, in passes of 32; panels: 6 and 12, in blocks of 144) from 0 to
65 (150 in the panels' odd-width test); widths whose end is not a whole vector or tile row of 32
terms (8, 100) check the masked loads and amx's zero-padded copy, odd widths the panels' last k
alone; output counts below and above one work item (dot: 4 rows of W; amx: 32; panels: chunks of
1, 2 or 4 panels of 16 columns) check the repeated, copied or partial rows. Each kernel runs where
this CPU's build has it and is skipped by name elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from loraserve.kernels import cpu, cpu_linear
from torch import nn

from loraserve.models.packed_linear import GemmKernel, PackedLinearGroup

Linear = Callable[[torch.Tensor, list[torch.Tensor], list[torch.Tensor | None]], list[torch.Tensor]]
BUILT = cpu.load_extension() is not None
PAIR_PANELS = pytest.mark.skipif(
    not BUILT or not cpu_linear.linear_pair_panels_available(),
    reason="panels of k pairs are not in this CPU's build (its target has no avx512_bf16)",
)
PLAIN_KERNELS = [
    pytest.param(
        GemmKernel.DOT,
        marks=pytest.mark.skipif(
            not BUILT or not cpu_linear.linear_dot_available(),
            reason="dot is not in this CPU's build (its target has no avx512_bf16)",
        ),
    ),
    pytest.param(
        GemmKernel.AMX,
        marks=pytest.mark.skipif(
            not BUILT or not cpu_linear.linear_amx_available(),
            reason="amx is not in this CPU's build (no amx_bf16/avx512_bf16) or the OS refused the tile state",
        ),
    ),
]
KERNELS = [*PLAIN_KERNELS, pytest.param(GemmKernel.PANELS, marks=PAIR_PANELS)]


def linear_pair_panels(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    panels, bias = cpu_linear.pack_pair_panels(weights, biases)
    return cpu_linear.linear_pair_panels(x, panels, bias, [w.shape[0] for w in weights])


FUNCTIONS: dict[GemmKernel, Linear] = {
    GemmKernel.DOT: cpu_linear.linear_dot,
    GemmKernel.AMX: cpu_linear.linear_amx,
    GemmKernel.PANELS: linear_pair_panels,
}


def assert_rounded_once(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape and out.is_contiguous()
    if not out.numel():
        return
    # the float32 sums' error: K additions of terms of at most |x| |w| each; then one rounding, at
    # most half a bfloat16 step (2^-8 relative) away
    slack = x.shape[1] * 2.0**-23 * (x.double().abs() @ weight.double().abs().T)
    near = exact.bfloat16().double()
    got = out.double()
    assert ((got - exact).abs() <= slack + 2.0**-8 * torch.maximum(got.abs(), exact.abs())).all()
    assert (got == near).double().mean() >= 0.95  # (a kernel that truncated would miss about half)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 65])
@pytest.mark.parametrize("width", [8, 100, 576])
def test_each_output_is_the_exact_result_rounded_once(kernel: GemmKernel, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    x = torch.randn(rows, width, generator=gen).bfloat16()
    weights = [torch.randn(out, width, generator=gen).bfloat16() for out in (13, 4, 7, 70)]
    biases = [None, torch.randn(4, generator=gen).bfloat16(), torch.randn(7, generator=gen).bfloat16(), None]
    outs = FUNCTIONS[kernel](x, weights, biases)
    for out, weight, bias in zip(outs, weights, biases, strict=True):
        assert_rounded_once(out, x, weight, bias)


@pytest.mark.parametrize("kernel", PLAIN_KERNELS)
def test_a_kernel_refuses_what_it_cannot_run(kernel: GemmKernel) -> None:
    linear, x = FUNCTIONS[kernel], torch.randn(2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-D bfloat16"):
        linear(x.float(), [torch.randn(4, 8).bfloat16()], [None])
    with pytest.raises(RuntimeError, match=r"bfloat16 \[out, 8\]"):
        linear(x, [torch.randn(4, 9).bfloat16()], [None])
    with pytest.raises(RuntimeError, match="one bias"):
        linear(x, [torch.randn(4, 8).bfloat16()], [])


@pytest.mark.parametrize("kernel", PLAIN_KERNELS)
def test_a_bfloat16_group_runs_on_the_kernel_without_a_copy(kernel: GemmKernel) -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(64, 40, bias=False).bfloat16(), nn.Linear(64, 24).bfloat16()]
    group = PackedLinearGroup(layers, (kernel,))
    assert group.packed_bytes() == 0  # it reads the layers' weights as they are
    x = torch.randn(6, 64).bfloat16()
    for out, layer in zip(group(x), layers, strict=True):
        assert_rounded_once(out, x, layer.weight.detach(), None if layer.bias is None else layer.bias.detach())


@PAIR_PANELS
@pytest.mark.parametrize("rows", [1, 6, 13, 150])
@pytest.mark.parametrize("width", [1, 33, 575])
def test_pair_panels_of_an_odd_width_leave_the_last_k_alone(rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    x = torch.randn(rows, width, generator=gen).bfloat16()
    weights = [torch.randn(out, width, generator=gen).bfloat16() for out in (16, 50, 72)]
    biases = [torch.randn(16, generator=gen).bfloat16(), None, torch.randn(72, generator=gen).bfloat16()]
    for out, weight, bias in zip(linear_pair_panels(x, weights, biases), weights, biases, strict=True):
        assert_rounded_once(out, x, weight, bias)


@PAIR_PANELS
def test_pair_panels_give_the_same_bits_on_any_number_of_threads() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(150, 96, generator=gen).bfloat16()  # two row blocks
    weights = [torch.randn(out, 96, generator=gen).bfloat16() for out in (576, 40, 200)]
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            results.append(torch.cat(linear_pair_panels(x, weights, [None] * 3), dim=1))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(results[0], other) for other in results[1:])


@PAIR_PANELS
def test_pair_panels_refuse_what_they_cannot_run() -> None:
    x = torch.randn(2, 8).bfloat16()
    panels, bias = cpu_linear.pack_pair_panels([torch.randn(20, 8).bfloat16()], [torch.randn(20).bfloat16()])
    assert panels.shape == (2, 4, 32) and bias is not None and bias.dtype == torch.float32
    with pytest.raises(RuntimeError, match="x must be a contiguous bfloat16"):
        cpu_linear.linear_pair_panels(x.float(), panels, bias, [20])
    with pytest.raises(RuntimeError, match=r"panels must be a contiguous bfloat16 \[num_panels, ceil"):
        cpu_linear.linear_pair_panels(torch.randn(2, 10).bfloat16(), panels, bias, [20])
    with pytest.raises(RuntimeError, match="out_sizes need 1 panels, got 2"):
        cpu_linear.linear_pair_panels(x, panels, bias, [16])
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        cpu_linear.linear_pair_panels(x, panels, bias.bfloat16(), [20])


@PAIR_PANELS
def test_a_bfloat16_group_on_panels_packs_pairs_once_and_matches_its_layers() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(64, 40, bias=False).bfloat16(), nn.Linear(64, 24).bfloat16()]
    group = PackedLinearGroup(layers, (GemmKernel.PANELS,))
    assert group.panels is not None and group.panels.shape == (3 + 2, 32, 32)  # 40 and 24 columns: 3 + 2 panels
    assert group.packed_bytes() == group.panels.numel() * 2 + 5 * 16 * 4  # the panels and the float32 bias
    x = torch.randn(20, 64).bfloat16()
    for out, layer in zip(group(x), layers, strict=True):
        assert_rounded_once(out, x, layer.weight.detach(), None if layer.bias is None else layer.bias.detach())
