"""The compiled paged decode attention (``kernels/cpu.py: paged_decode_attention``) against the torch
reference, on each variant this build has: ``pairs`` (bfloat16 scores by AVX512-BF16 pair dots,
csrc/decode_attention_pairs.h; bfloat16 only, head dims of 32-128 in steps of 32, block sizes
that are multiples of 16), ``avx512`` (16 lanes, csrc/decode_attention_wide.h;
block sizes that are multiples of 16, head dims of 16-128 in steps of 16, bfloat16 in steps of
32) and ``vec8`` (8 lanes, csrc/decode_attention_tiled.h; block sizes that are multiples of 8,
head dims 16/32/48/64/96/128); other shapes run the next variant that can, the generic loops
last. GQA and MHA, scattered pages, contexts of 1 token, exact multiples of the block size and
padded block tables, float32 and bfloat16. A variant this build lacks is skipped by name."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import ATTENTION_CASES, ATTENTION_IDS, decode_case, make_paged
from loraserve.kernels import cpu, cpu_features
from loraserve.kernels.paged_attention import paged_decode_attention

BUILT = cpu.load_extension() is not None
pytestmark = pytest.mark.skipif(not BUILT, reason="the C++ CPU kernels could not be built")
COMPILED = cpu.decode_attention_variants() if BUILT else []


@pytest.fixture(params=["pairs", "avx512", "vec8"])
def variant(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if name not in COMPILED:
        pytest.skip(f"decode attention variant {name!r} is not in this CPU's build ({cpu_features.summary()})")
    return name


TILED_CASES = [(8, 2, 128, 16), (4, 2, 64, 8), (4, 2, 16, 16), (6, 3, 48, 8), (4, 1, 96, 16), (6, 2, 80, 32)]
TILED_IDS = ["head-dim-128", "block-8", "head-dim-16", "head-dim-48", "96-mqa", "head-dim-80-block-32"]


SHAPE_NAMES = ("num_heads", "num_kv_heads", "head_dim", "block_size")


@pytest.mark.parametrize(SHAPE_NAMES, ATTENTION_CASES + TILED_CASES, ids=ATTENTION_IDS + TILED_IDS)
def test_decode_attention_matches_reference(
    variant: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    query, kv, tables, context_lens, scale = decode_case(num_heads, num_kv_heads, head_dim, block_size)
    expected = paged_decode_attention(query, kv, tables, context_lens, scale)
    out = cpu.paged_decode_attention(query, kv, tables, context_lens, scale, variant=variant)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("slope", [3.0, -3.0], ids=["rising", "falling"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_attention_scores_that_drift_across_pages(
    variant: str, slope: float, block_size: int, dtype: torch.dtype
) -> None:
    """The tiled kernels' online softmax rescales what it summed whenever a later page holds a
    larger score. Scores that rise ~120 over the context (the first pages' weights fall below
    exp's range, -87) or fall (the first page's max stands): scores that large carry float32
    rounding of ~1e-5, so the kernel is held to twice the float32 reference's error against float64
    (of the same bfloat16 values in bfloat16, plus the output's one rounding, 2^-8 relative)."""
    lens, num_heads, num_kv_heads, head_dim = [130, 47], 9, 3, 64
    kv, tables = make_paged(lens, num_kv_heads, head_dim, block_size, torch.float32, seed=11)
    query = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(3))
    direction = query.view(len(lens), num_kv_heads, -1, head_dim).mean(2)  # [seqs, kv_heads, head_dim]
    for seq, n in enumerate(lens):
        for j in range(n):
            page, row = tables[seq, j // block_size], j % block_size
            kv[page, 0, row] = 0.1 * kv[page, 0, row] + slope * (j - n / 2) / 8 * direction[seq]
    query, kv = query.to(dtype), kv.to(dtype)
    context_lens, scale = torch.tensor(lens), head_dim**-0.5
    exact = paged_decode_attention(query.double(), kv.double(), tables, context_lens, scale)
    float_out = paged_decode_attention(query.float(), kv.float(), tables, context_lens, scale).double()
    reference_error = (float_out - exact).abs().max()
    out = cpu.paged_decode_attention(query, kv, tables, context_lens, scale, variant=variant)
    assert out.dtype == dtype
    error = (out.double() - exact).abs() - (exact.abs() * 2**-8 if dtype == torch.bfloat16 else 0)
    assert error.max() <= 2 * reference_error + 1e-6, (float(error.max()), float(reference_error))


@pytest.mark.parametrize(
    SHAPE_NAMES,
    [(6, 2, 32, 16), (4, 2, 24, 16), (9, 3, 64, 32), *TILED_CASES],
    ids=["32", "generic-head-dim-24", "64-block-32", *TILED_IDS],
)
def test_decode_attention_bfloat16_is_the_float32_result_rounded_once(
    variant: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """bfloat16 query and KV (widened as read, float32 sums) on the register-tiled kernels and the
    generic loops: each output is the float32 reference of the same values rounded once to
    bfloat16, so within half a bfloat16 step (at most 2^-8 relative) plus the sums' float32 error."""
    lens = [5, 40, 129, 16]
    kv, tables = make_paged(lens, num_kv_heads, head_dim, block_size, torch.bfloat16, seed=7)
    query = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(2))
    query = query.to(torch.bfloat16)
    expected = paged_decode_attention(query.float(), kv.float(), tables, torch.tensor(lens), 0.2)
    out = cpu.paged_decode_attention(query, kv, tables, torch.tensor(lens), 0.2, variant=variant)
    assert out.dtype == torch.bfloat16
    error = (out.float() - expected).abs()
    bound = expected.abs() * 2**-8 + 1e-6
    assert (error <= bound).all(), (float((error - bound).max()), float(expected[error > bound].abs().min()))


def test_the_variants_of_this_build() -> None:
    """``avx512`` is compiled in exactly where the build targets AVX-512 (this CPU has avx512f),
    ``pairs`` where it targets AVX512-BF16 too; and each runs the shapes it says it tiles."""
    info = cpu_features.cpu_info()
    assert COMPILED[-1] == "vec8"
    assert ("avx512" in COMPILED) == info.has("avx512f"), COMPILED
    assert ("pairs" in COMPILED) == (info.has("avx512f") and info.has("avx512_bf16")), COMPILED
    expected = (["pairs"] if "pairs" in COMPILED else []) + (["avx512"] if "avx512" in COMPILED else []) + ["vec8"]
    assert cpu.decode_attention_tilings(torch.bfloat16, 64, 16) == expected
    assert "pairs" not in cpu.decode_attention_tilings(torch.float32, 64, 16)
    assert "pairs" not in cpu.decode_attention_tilings(torch.bfloat16, 48, 16)
    assert "pairs" not in cpu.decode_attention_tilings(torch.bfloat16, 64, 8)


def test_decode_attention_checks_page_ids_and_its_variant(variant: str) -> None:
    query, kv, tables, lens, scale = decode_case(9, 3, 64, 16)
    bad = tables.clone()
    bad[2, 1] = -1
    with pytest.raises(RuntimeError, match=r"sequence 2 block 1: page -1 is outside the pool"):
        cpu.paged_decode_attention(query, kv, bad, lens, scale, variant=variant)
    with pytest.raises(RuntimeError, match=r"needs \d+ blocks, its table has"):
        cpu.paged_decode_attention(query, kv, tables[:, :1].contiguous(), lens, scale, variant=variant)
    with pytest.raises(RuntimeError, match=r"variant 'avx1024' is not compiled into this build"):
        cpu.paged_decode_attention(query, kv, tables, lens, scale, variant="avx1024")
