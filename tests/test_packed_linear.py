"""Packed oneDNN projections: nn.Linear semantics for small batches, F.linear on the plain weights above."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from loraserve.models.llama import LlamaForCausalLM
from loraserve.models.packed_linear import PackedGroup, PackedLinear, can_pack, pack_llama_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(2, 2)), reason="this torch build has no oneDNN packing")


def random_linear(gen: torch.Generator, in_features: int, out_features: int, bias: bool) -> nn.Linear:
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen))
        if linear.bias is not None:
            linear.bias.copy_(torch.randn(out_features, generator=gen))
    return linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_group_matches_each_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    linears = [random_linear(gen, 96, out, bias) for out in (200, 24, 24)]
    group = PackedGroup(linears, batch_hint=64, max_rows=512)
    x = torch.randn(rows, 96, generator=gen)
    outs = group(x)
    assert [tuple(out.shape) for out in outs] == [(rows, 200), (rows, 24), (rows, 24)]
    for out, linear in zip(outs, linears, strict=True):
        assert out.is_contiguous()  # the LoRA kernels and the attention views need that
        torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-4)


def test_large_batches_and_other_shapes_use_the_plain_weights_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    linear = random_linear(gen, 32, 48, bias=True)
    packed = PackedLinear(linear, batch_hint=8, max_rows=16)
    big = torch.randn(17, 32, generator=gen)
    assert torch.equal(packed(big), F.linear(big, linear.weight, linear.bias))
    batched = torch.randn(2, 3, 32, generator=gen)  # not 2-D: plain F.linear too
    assert torch.equal(packed(batched), F.linear(batched, linear.weight, linear.bias))
    small = torch.randn(3, 32, generator=gen)
    torch.testing.assert_close(packed(small), F.linear(small, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_packing_a_llama_keeps_its_state_dict_and_tied_head() -> None:
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    keys = set(model.state_dict())
    assert pack_llama_linears(model, batch_hint=4) == 1 + 7 * 2
    assert set(model.state_dict()) == keys  # same names (o_proj.bias included), no packed copies
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.o_proj, PackedLinear) and attn.project_qkv is not None
    x = torch.randn(5, 32)
    for out, linear in zip(attn.project_qkv(x), (attn.q_proj, attn.k_proj, attn.v_proj), strict=True):
        torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    assert pack_llama_linears(model, batch_hint=4) == 0  # already packed
