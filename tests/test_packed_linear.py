"""PackedLinear: nn.Linear semantics on oneDNN-packed weights for small batches, F.linear above."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loraserve.models.packed_linear import PackedLinear, can_pack, pack_linears

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
