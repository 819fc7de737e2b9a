"""The bfloat16 ``dot`` GEMM kernel (kernels/csrc/linear_dot.cpp) against the float64 result.

Its products of bfloat16 pairs are exact and its sums float32, and each output is rounded once:
so every output is the float64 result rounded to bfloat16, except where that result lies within
the float32 sums' error of a rounding boundary, where it may be the neighbour. Row counts cover
partial and whole tiles of 4 rows (0-9, 17); widths whose end is not a whole vector of 32 terms
(8, 100) check the masked loads; output counts not a multiple of 4 check the tile's repeated rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loraserve.kernels import cpu
from torch import nn

from loraserve.models.packed_linear import GemmKernel, PackedLinearGroup

pytestmark = pytest.mark.skipif(
    cpu.load_extension() is None or not cpu.linear_dot_available(),
    reason="linear_dot is not in this CPU's build (its target has no avx512_bf16)",
)


def assert_rounded_once(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape and out.is_contiguous()
    if not out.numel():
        return
    # the float32 sums' error: K additions of terms of at most |x| |w| each
    slack = x.shape[1] * 2.0**-23 * (x.double().abs() @ weight.double().abs().T)
    near = exact.bfloat16().double()
    below = (exact - slack).bfloat16().double()
    above = (exact + slack).bfloat16().double()
    got = out.double()
    assert ((got == near) | (got == below) | (got == above)).all()
    assert (got == near).double().mean() >= 0.95  # (a kernel that truncated would miss about half)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 7, 8, 9, 17])
@pytest.mark.parametrize("width", [8, 100, 576])
def test_linear_dot_rounds_the_exact_result_once(rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    x = torch.randn(rows, width, generator=gen).bfloat16()
    weights = [torch.randn(out, width, generator=gen).bfloat16() for out in (13, 4, 7)]
    biases = [None, torch.randn(4, generator=gen).bfloat16(), torch.randn(7, generator=gen).bfloat16()]
    outs = cpu.linear_dot(x, weights, biases)
    for out, weight, bias in zip(outs, weights, biases, strict=True):
        assert_rounded_once(out, x, weight, bias)


def test_linear_dot_refuses_what_it_cannot_run() -> None:
    x = torch.randn(2, 8).bfloat16()
    with pytest.raises(RuntimeError, match="x must be a contiguous 2-D bfloat16"):
        cpu.linear_dot(x.float(), [torch.randn(4, 8).bfloat16()], [None])
    with pytest.raises(RuntimeError, match=r"bfloat16 \[out, 8\]"):
        cpu.linear_dot(x, [torch.randn(4, 9).bfloat16()], [None])
    with pytest.raises(RuntimeError, match="one bias"):
        cpu.linear_dot(x, [torch.randn(4, 8).bfloat16()], [])


def test_a_bfloat16_group_runs_on_the_dot_kernel_without_a_copy() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(64, 40, bias=False).bfloat16(), nn.Linear(64, 24).bfloat16()]
    group = PackedLinearGroup(layers, (GemmKernel.DOT,))
    assert group.packed_bytes() == 0  # it reads the layers' weights as they are
    x = torch.randn(6, 64).bfloat16()
    for out, layer in zip(group(x), layers, strict=True):
        assert_rounded_once(out, x, layer.weight.detach(), None if layer.bias is None else layer.bias.detach())
