"""bfloat16 prefill attention on AMX tiles (kernels/csrc/prefill_attention_amx.h) and on the vector
loops (``tiles=False``), against the float32 reference (kernels/paged_attention.py), over head
shapes (grouped, multi-head, multi-query, head_dim 16 to 256) and chunks that start on
cached prefixes, cross the 64-row work items and the 64-key steps of the walk, and end inside a
16-vector tile. The tiles round the probabilities once to bfloat16: their error may exceed the
output's own rounding, but only by a little (a probability left unnormalised, a key left out or a
row's mask off by one would be far outside)."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_cases import ATTENTION_CASES, ATTENTION_IDS, make_paged
from loraserve.kernels import cpu, cpu_features
from loraserve.kernels.paged_attention import paged_prefill_attention_varlen

BUILT = cpu.load_extension() is not None
pytestmark = pytest.mark.skipif(not BUILT, reason="the compiled CPU kernels did not build")
NO_TILES = (
    "the prefill attention's AMX tiles are not in this CPU's build (no amx_bf16/avx512_bf16) or the OS refused them"
)
WAYS = [
    pytest.param(
        True, id="amx-tiles", marks=pytest.mark.skipif(BUILT and not cpu.prefill_attention_amx(), reason=NO_TILES)
    ),
    pytest.param(False, id="vector-loops"),
]
# (cached, new) per chunk: from scratch, over cached prefixes, single tokens, past one 64-row item
# and one 64-key step, and ending inside a 16-vector tile
CHUNKS = [(0, 1), (0, 15), (0, 17), (5, 1), (16, 16), (31, 40), (0, 64), (0, 130), (70, 3), (100, 77), (200, 1)]


def test_the_tiles_are_used_where_the_cpu_has_them() -> None:
    """Built in and granted on every CPU with AMX bfloat16 tiles (no silent fall back there)."""
    info = cpu_features.cpu_info()
    has_amx = all(info.has(f) for f in ("amx_tile", "amx_bf16", "avx512_bf16", "avx512bw"))
    assert cpu.prefill_attention_amx() is has_amx


# and head_dim 80, 128 and 256: the values' product in more than one pass of 64 columns
HEAD_CASES = [*ATTENTION_CASES, (4, 1, 80, 8), (8, 2, 128, 16), (2, 2, 256, 16)]
HEAD_IDS = [*ATTENTION_IDS, "head-dim-80", "head-dim-128", "head-dim-256"]


@pytest.mark.parametrize("tiles", WAYS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), HEAD_CASES, ids=HEAD_IDS)
def test_bfloat16_prefill_attention_is_near_the_float32_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, tiles: bool
) -> None:
    kv, tables = make_paged([c + n for c, n in CHUNKS], num_kv_heads, head_dim, block_size, torch.bfloat16, seed=5)
    starts = torch.tensor([0, *itertools.accumulate(n for _, n in CHUNKS)])
    cached = torch.tensor([c for c, _ in CHUNKS])
    gen = torch.Generator().manual_seed(6)
    # queries scaled up so that the softmax is peaked (as trained models' are), not near-uniform
    query = (torch.randn(int(starts[-1]), num_heads, head_dim, generator=gen) * 3).to(torch.bfloat16)
    scale = head_dim**-0.5
    out = cpu.paged_prefill_attention(query, kv, starts, cached, tables, scale, tiles=tiles)
    exact = paged_prefill_attention_varlen(query.float(), kv.float(), starts, cached, tables, scale)
    assert out.dtype == torch.bfloat16 and out.shape == query.shape
    error = (out.float() - exact).abs()
    rounding = (exact.bfloat16().float() - exact).abs()  # the output's own rounding
    assert error.max() <= 2 * rounding.max() + 2**-9
    assert error.mean() <= (1.3 if tiles else 1.05) * rounding.mean() + 1e-6


@pytest.mark.skipif(BUILT and not cpu.prefill_attention_amx(), reason=NO_TILES)
def test_the_tiles_read_only_each_chunks_own_pages() -> None:
    """A second step with other chunks over the same pool gives each chunk the output it has
    alone: the item's buffers (keys, values, sums) carry nothing from one item to the next."""
    kv, tables = make_paged([150, 40, 90], 3, 64, 16, torch.bfloat16, seed=8)
    gen = torch.Generator().manual_seed(9)
    query = torch.randn(150 + 40 + 90, 9, 64, generator=gen).to(torch.bfloat16)
    starts = torch.tensor([0, 150, 190, 280])
    together = cpu.paged_prefill_attention(query, kv, starts, torch.zeros(3, dtype=torch.long), tables, 0.125)
    for s in range(3):
        rows = slice(int(starts[s]), int(starts[s + 1]))
        alone = cpu.paged_prefill_attention(
            query[rows],
            kv,
            torch.tensor([0, rows.stop - rows.start]),
            torch.zeros(1, dtype=torch.long),
            tables[s : s + 1],
            0.125,
        )
        assert torch.equal(alone, together[rows]), s


@pytest.mark.parametrize("tiles", WAYS)
def test_steps_and_chunks_without_query_rows(tiles: bool) -> None:
    """A step with no prefill rows gives an empty output; a chunk without rows between others
    leaves its neighbours' outputs as they are alone."""
    kv, tables = make_paged([70, 8, 20], 3, 64, 16, torch.bfloat16, seed=10)
    none = torch.zeros(0, 9, 64, dtype=torch.bfloat16)
    empty = cpu.paged_prefill_attention(
        none, kv, torch.tensor([0]), torch.zeros(0, dtype=torch.long), tables[:0], 0.125, tiles=tiles
    )
    assert empty.shape == (0, 9, 64)
    query = torch.randn(70 + 12, 9, 64, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    cached = torch.tensor([0, 8, 8])
    out = cpu.paged_prefill_attention(query, kv, torch.tensor([0, 70, 70, 82]), cached, tables, 0.125, tiles=tiles)
    for rows, s in ((slice(0, 70), 0), (slice(70, 82), 2)):
        alone = cpu.paged_prefill_attention(
            query[rows],
            kv,
            torch.tensor([0, rows.stop - rows.start]),
            cached[s : s + 1],
            tables[s : s + 1],
            0.125,
            tiles=tiles,
        )
        assert torch.equal(out[rows], alone), s
