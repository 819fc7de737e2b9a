"""PackedLinear: nn.Linear semantics on oneDNN-packed weights for small batches, F.linear above."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loraserve.models.packed_linear import PackedLinear, PackedLinearGroup, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(2, 2)), reason="this torch build has no oneDNN packing")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(200, generator=gen))
    packed = PackedLinear(linear, batch_hint=64, max_rows=512)
    x = torch.randn(rows, 96, generator=gen)
    out = packed(x)
    assert out.shape == (rows, 200) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-4)


def test_large_batches_and_other_shapes_use_the_plain_weight_bit_for_bit() -> None:
    linear = nn.Linear(32, 48)
    packed = PackedLinear(linear, batch_hint=8, max_rows=16)
    big = torch.randn(17, 32)
    assert torch.equal(packed(big), F.linear(big, linear.weight, linear.bias))
    batched = torch.randn(2, 3, 32)  # not 2-D: plain F.linear too
    assert torch.equal(packed(batched), F.linear(batched, linear.weight, linear.bias))


def test_pack_linears_replaces_every_linear_and_keeps_tied_weights_shared() -> None:
    embed = nn.Embedding(50, 16)
    model = nn.ModuleDict({"embed": embed, "proj": nn.Linear(16, 16), "head": nn.Linear(16, 50, bias=False)})
    model["head"].weight = embed.weight
    state_keys = set(model.state_dict())
    assert pack_linears(model, batch_hint=4) == 2
    assert isinstance(model["proj"], PackedLinear) and isinstance(model["head"], PackedLinear)
    assert model["head"].weight is embed.weight  # still tied
    assert set(model.state_dict()) == state_keys  # the packed copy is not state
    assert pack_linears(model, batch_hint=4) == 0  # idempotent: nothing left to pack


class _SharedInput(nn.Module):
    """Three projections of one input (one with a bias) declared as a group, and one that is not."""

    fused_groups: ClassVar[dict[str, tuple[str, ...]]] = {"abc_packed": ("a", "b", "c")}

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(24, 40, bias=False), nn.Linear(24, 8, bias=True)
        self.c = nn.Linear(24, 16, bias=False)
        self.out = nn.Linear(40, 24)
        self.abc_packed: PackedLinearGroup | None = None


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_group_matches_its_layers(rows: int) -> None:
    torch.manual_seed(rows)
    module = _SharedInput()
    group = PackedLinearGroup([module.a, module.b, module.c], batch_hint=64, max_rows=512)
    x = torch.randn(rows, 24)
    outs = group(x)
    assert [o.shape for o in outs] == [(rows, 40), (rows, 8), (rows, 16)]
    assert all(o.is_contiguous() for o in outs)  # the LoRA kernels add into them in place
    for out, linear in zip(outs, (module.a, module.b, module.c), strict=True):
        torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    big = torch.randn(513, 24)  # past max_rows: each layer's own F.linear, bit for bit
    for out, linear in zip(group(big), (module.a, module.b, module.c), strict=True):
        assert torch.equal(out, F.linear(big, linear.weight, linear.bias))


def test_pack_linears_builds_declared_groups_and_packs_the_rest() -> None:
    module = _SharedInput()
    state_keys = set(module.state_dict())
    assert pack_linears(module, batch_hint=4) == 4  # a, b, c in the group, out alone
    assert isinstance(module.abc_packed, PackedLinearGroup)
    assert all(type(getattr(module, name)) is nn.Linear for name in "abc")  # members stay as they are
    assert isinstance(module.out, PackedLinear)
    assert set(module.state_dict()) == state_keys  # neither the group nor the packed copies are state
    assert pack_linears(module, batch_hint=4) == 0
    with pytest.raises(ValueError, match="share in_features"):
        PackedLinearGroup([module.a, nn.Linear(8, 8)], batch_hint=4)
