"""The compiled CPU kernels' fused elementwise ops (``kernels/cpu.py``: RMSNorm with the residual
add, RoPE in place, SiLU-and-mul) against the model's torch ops, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from loraserve.kernels import cpu

pytestmark = pytest.mark.skipif(cpu.load_extension() is None, reason="the C++ CPU kernels could not be built")


def test_rms_norm_matches_the_model_norm() -> None:
    from loraserve.models.llama import RMSNorm

    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=gen)
    x, residual = torch.randn(37, 96, generator=gen) * 3, torch.randn(37, 96, generator=gen)
    torch.testing.assert_close(cpu.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=1e-6, atol=1e-6)
    expected_sum = residual + x
    expected = norm(expected_sum)
    out = cpu.rms_norm(x, norm.weight, 1e-5, residual)
    assert torch.equal(residual, expected_sum)  # the residual stream is updated in place, exactly
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_rope_in_place_equals_apply_rope_bit_for_bit() -> None:
    from loraserve.models.rope import apply_rope

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(23, 6, 64, generator=gen)
    angles = torch.rand(23, 32, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)  # [num_tokens, head_dim], as RotaryEmbedding builds it
    cos, sin = emb.cos() * 1.1, emb.sin() * 1.1
    expected = apply_rope(x, cos, sin)
    cpu.rope_(x, cos, sin)
    assert torch.equal(x, expected)


def test_rms_norm_bfloat16_rounds_where_the_model_norm_rounds() -> None:
    """bfloat16 (the residual add, the normalized value and the weight product each rounded, as the
    model's torch ops round them): equal to the model's norm but where 1 / sqrt and torch's rsqrt
    differ in the last float32 bit, at most one bfloat16 step apart."""
    from loraserve.models.llama import RMSNorm

    gen = torch.Generator().manual_seed(6)
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    norm.weight.data = torch.randn(576, generator=gen).to(torch.bfloat16)
    x = (torch.randn(64, 576, generator=gen) * 3).to(torch.bfloat16)
    residual = torch.randn(64, 576, generator=gen).to(torch.bfloat16)
    expected_sum = residual.clone().add_(x)
    expected = norm(x.clone(), residual=residual.clone())
    out = cpu.rms_norm(x, norm.weight.data, 1e-5, residual)
    assert out.dtype == torch.bfloat16 and torch.equal(residual, expected_sum)  # the sum, rounded as add_
    assert (out == expected).float().mean() > 0.99
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=0)
    torch.testing.assert_close(cpu.rms_norm(x, norm.weight.data, 1e-5).float(), norm(x).float(), rtol=2**-7, atol=0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        cpu.rms_norm(x.half(), norm.weight.data.half(), 1e-5)


def test_bfloat16_rounding_keeps_torch_bits_for_denormals_and_nans() -> None:
    """Where the CPU has AVX512-BF16 the kernels round with VCVTNEPS2BF16, which flushes float32
    denormals to zero; lanes holding a denormal or a NaN take the integer rounding, so the residual
    sum has torch's bits on every CPU (NaNs stay NaNs: the kernels write 0x7FC0, torch 0xFFFF)."""
    gen = torch.Generator().manual_seed(10)
    x = (torch.randn(4, 576, generator=gen) * 1e-39).to(torch.bfloat16)  # float32 denormals
    residual = (torch.randn(4, 576, generator=gen) * 1e-39).to(torch.bfloat16)
    x[1, 5], residual[2, 17] = -float("nan"), float("nan")
    x[3], residual[3] = torch.randn(576, generator=gen).to(torch.bfloat16), torch.randn(576, generator=gen)
    expected = residual.clone().add_(x)
    assert (expected[0] != 0).sum() > 100  # sums that stay denormal
    cpu.rms_norm(x, torch.ones(576, dtype=torch.bfloat16), 1e-5, residual)
    nan = expected.isnan()
    assert nan.sum() == 2 and torch.equal(residual.isnan(), nan)
    assert torch.equal(residual.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])


def test_rope_bfloat16_in_place_equals_the_model_rope_bit_for_bit() -> None:
    from loraserve.models.rope import RotaryEmbedding

    gen = torch.Generator().manual_seed(7)
    config = type("Config", (), {"head_dim": 64, "hidden_size": 576, "num_attention_heads": 9, "rope_theta": 1e5})()
    tables = RotaryEmbedding(config)(torch.randint(0, 4000, (23,), generator=gen), torch.bfloat16)
    x = torch.randn(23, 9, 64, generator=gen).to(torch.bfloat16)
    expected = tables.apply(x)  # the model's torch ops in bfloat16
    cpu.rope_(x, tables.cos, tables.sin)
    assert torch.equal(x, expected)
    # q as a column slice of one q/k/v output (the unpacked projections): tokens at a wider stride
    qkv = torch.randn(23, (9 + 3 + 3) * 64, generator=gen).to(torch.bfloat16)
    q = qkv[:, : 9 * 64].view(23, 9, 64)
    expected, rest = tables.apply(q.contiguous()), qkv[:, 9 * 64 :].clone()
    cpu.rope_(q, tables.cos, tables.sin)
    assert torch.equal(q, expected) and torch.equal(qkv[:, 9 * 64 :], rest)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "views-of-one-output"])
def test_silu_and_mul_float32_matches_the_torch_ops(strided: bool) -> None:
    """Within a few float32 ulp of ``F.silu(gate, inplace=True).mul_(up)`` (the exp is a polynomial,
    not torch's), over values from far below zero (silu -> 0, no NaN) to far above (silu(g) = g);
    gate and up may be column slices of one [tokens, 2 * width] output (the row stride differs)."""
    gen = torch.Generator().manual_seed(8)
    width = 1536 + 5  # not a multiple of any vector width
    both = torch.randn(37, 2 * width, generator=gen) * 4
    both[0, :8] = torch.tensor([-200.0, -90.0, -87.5, -20.0, 0.0, 20.0, 89.0, 300.0])
    gate, up = (both[:, :width], both[:, width:]) if strided else (both[:, :width].clone(), both[:, width:].clone())
    expected = torch.nn.functional.silu(gate.clone()).mul_(up)
    cpu.silu_and_mul_(gate, up)
    assert torch.isfinite(gate).all()
    torch.testing.assert_close(gate, expected, rtol=4e-7, atol=1e-30)
    if strided:
        assert torch.equal(both[:, width:], up)  # up untouched


def test_silu_and_mul_bfloat16_rounds_where_the_torch_ops_round() -> None:
    """bfloat16: silu rounded, then the product rounded, as the two torch ops do; equal to them but
    where the two float32 exps differ across a bfloat16 rounding boundary (one step apart). Widths
    with a scalar tail after the vectors (8 or 16 lanes) and one narrower than a vector."""
    gen = torch.Generator().manual_seed(9)
    for width in (1536 + 5, 13):
        gate = (torch.randn(64, width, generator=gen) * 3).to(torch.bfloat16)
        up = torch.randn(64, width, generator=gen).to(torch.bfloat16)
        expected = torch.nn.functional.silu(gate.clone()).mul_(up)
        cpu.silu_and_mul_(gate, up)
        assert (gate == expected).float().mean() > 0.995, width
        torch.testing.assert_close(gate.float(), expected.float(), rtol=2**-7, atol=0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        cpu.silu_and_mul_(gate.half(), up.half())
    with pytest.raises(RuntimeError, match="columns contiguous"):
        cpu.silu_and_mul_(gate.t(), up.t())
