"""The panel GEMM (``kernels/cpu.py: linear_panels``) and the layers on it, against ``F.linear``.

Row counts cover a partial register tile (1, 5, 7 rows), whole tiles and row blocks (6, 64),
and several row blocks with a ragged end (130); output widths that are not multiples of the
16-column panel check the padded last panel; groups check that each output gets exactly its
own panels. The reference is ``F.linear`` in float64, and the kernel is held to the error
that ``F.linear`` in float32 makes against it (times 2, plus a little absolute slack): a
different order of float additions, nothing more.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from loraserve.kernels import cpu
from torch import nn

from loraserve.models.packed_linear import PackedLinear, PackedLinearGroup, can_pack, pack_linears

pytestmark = pytest.mark.skipif(cpu.load_extension() is None, reason="the C++ CPU kernels could not be built")

ROWS = [0, 1, 5, 6, 7, 64, 130]


def assert_float_close(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``out`` is as close to the float64 result as float32 ``F.linear`` is (x2, + 1e-5)."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.dtype == torch.float32 and out.shape == exact.shape
    if out.numel():
        float_error = (F.linear(x, weight, bias).double() - exact).abs().max()
        assert (out.double() - exact).abs().max() <= 2 * float_error + 1e-5


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", ROWS)
def test_linear_panels_matches_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=gen)  # 200 = 12 panels + 8 columns
    b = torch.randn(200, generator=gen) if bias else None
    panels, panel_bias = cpu.pack_panels([weight], [b])
    assert panels.shape == (13, 96, 16) and (panel_bias is None) == (not bias)
    x = torch.randn(rows, 96, generator=gen)
    (out,) = cpu.linear_panels(x, panels, panel_bias, [200])
    assert out.is_contiguous()
    assert_float_close(out, x, weight, b)


def test_linear_panels_checks_its_arguments() -> None:
    panels, _ = cpu.pack_panels([torch.randn(32, 8)])
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="need 3 panels, got 2"):
        cpu.linear_panels(x, panels, None, [40])
    with pytest.raises(RuntimeError, match="matching x"):
        cpu.linear_panels(torch.randn(3, 9), panels, None, [32])
    with pytest.raises(RuntimeError, match="float32 only"):
        cpu.linear_panels(x.double(), panels, None, [32])


def test_packed_linear_keeps_nn_linear_semantics() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 40)
    packed = PackedLinear(linear)
    x = torch.randn(9, 48)
    assert_float_close(packed(x), x, linear.weight, linear.bias)
    batched = torch.randn(2, 3, 48)  # not 2-D: plain F.linear, bit for bit
    assert torch.equal(packed(batched), F.linear(batched, linear.weight, linear.bias))


def test_pack_linears_replaces_every_linear_and_keeps_tied_weights_shared() -> None:
    embed = nn.Embedding(50, 16)
    model = nn.ModuleDict({"embed": embed, "proj": nn.Linear(16, 16), "head": nn.Linear(16, 50, bias=False)})
    model["head"].weight = embed.weight
    state_keys = set(model.state_dict())
    assert pack_linears(model) == 2
    assert isinstance(model["proj"], PackedLinear) and isinstance(model["head"], PackedLinear)
    assert model["head"].weight is embed.weight  # still tied
    assert set(model.state_dict()) == state_keys  # the panels are not state
    assert pack_linears(model) == 0  # idempotent: nothing left to pack
    assert not can_pack(torch.zeros(4, 4, dtype=torch.bfloat16))  # the kernel is float32 only


class _SharedInput(nn.Module):
    """Three projections of one input (one with a bias) declared as a group, and one that is not."""

    fused_groups: ClassVar[dict[str, tuple[str, ...]]] = {"abc_packed": ("a", "b", "c")}

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(24, 40, bias=False), nn.Linear(24, 8, bias=True)
        self.c = nn.Linear(24, 16, bias=False)
        self.out = nn.Linear(40, 24)
        self.abc_packed: PackedLinearGroup | None = None


@pytest.mark.parametrize("rows", ROWS)
def test_packed_linear_group_matches_its_layers(rows: int) -> None:
    torch.manual_seed(rows)
    module = _SharedInput()
    group = PackedLinearGroup([module.a, module.b, module.c])
    assert group.panels.shape == (3 + 1 + 1, 24, 16)  # 40 -> 3 panels, 8 -> 1, 16 -> 1
    x = torch.randn(rows, 24)
    outs = group(x)
    assert [o.shape for o in outs] == [(rows, 40), (rows, 8), (rows, 16)]
    assert all(o.is_contiguous() for o in outs)  # the LoRA kernels add into them in place
    for out, linear in zip(outs, (module.a, module.b, module.c), strict=True):
        assert_float_close(out, x, linear.weight, linear.bias)


def test_pack_linears_builds_declared_groups_and_packs_the_rest() -> None:
    module = _SharedInput()
    state_keys = set(module.state_dict())
    assert pack_linears(module) == 4  # a, b, c in the group, out alone
    assert isinstance(module.abc_packed, PackedLinearGroup)
    assert all(type(getattr(module, name)) is nn.Linear for name in "abc")  # members stay as they are
    assert isinstance(module.out, PackedLinear)
    assert set(module.state_dict()) == state_keys  # neither the group nor the panels are state
    assert pack_linears(module) == 0
    with pytest.raises(ValueError, match="share in_features"):
        PackedLinearGroup([module.a, nn.Linear(8, 8)])
