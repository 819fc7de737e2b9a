"""The one-launch paged attention (``kernels/triton_unified_attention.py``) against its torch
twin (``paged_attention_reference``: gather + SDPA per sequence), on mixed steps: decode
tokens, prefills from nothing and prefills over cached prefixes that cross pages, with GQA
groups 1, 4 and 8 (and 3), block sizes 8/16/32, float32 and float16, and the split-KV path.
Compiled on a GPU; in Triton's interpreter elsewhere (tiny grids)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import make_paged
from loraserve.kernels.paged_attention import paged_attention_reference, paged_decode_attention

unified = pytest.importorskip("loraserve.kernels.triton_unified_attention")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (query rows per sequence, context after the step per sequence): decode tokens (1 row), a
# prefill from nothing (rows == context), prefills over a cached prefix (rows < context).
DECODE_ONLY = ([1, 1, 1, 1], [1, 17, 40, 9])
PREFILL_ONLY = ([5, 19], [5, 19])
MIXED = ([1, 1, 1, 7, 20, 3], [33, 8, 1, 7, 45, 70])


def run_case(
    shape: tuple[list[int], list[int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    num_splits: int = 1,
    padded_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, float32 reference) of one case; ``padded_rows`` extra query rows that no
    sequence covers are appended (they must stay untouched)."""
    rows, lens = shape
    kv, tables = make_paged(lens, num_kv_heads, head_dim, block_size, torch.float32, seed=head_dim + block_size)
    num_tokens = sum(rows)
    gen = torch.Generator().manual_seed(num_heads)
    query = torch.randn(num_tokens + padded_rows, num_heads, head_dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
    seq_lens = torch.tensor(lens)
    scale = head_dim**-0.5
    query, kv = query.to(dtype), kv.to(dtype)
    expected = paged_attention_reference(query.float(), kv.float(), starts, seq_lens, tables, scale)
    out = torch.full_like(query, 7.0).to(DEVICE)
    unified.unified_attention(
        query.to(DEVICE),
        kv.to(DEVICE),
        starts.to(DEVICE),
        seq_lens.to(DEVICE),
        tables.to(DEVICE),
        scale,
        out=out,
        num_splits=num_splits,
    )
    if padded_rows:
        assert bool((out[num_tokens:] == 7.0).all()), "rows no sequence covers were written"
        out, expected = out[:num_tokens], expected[:num_tokens]
    return out.float().cpu(), expected


@pytest.mark.parametrize("shape", [DECODE_ONLY, PREFILL_ONLY, MIXED], ids=["decode", "prefill", "mixed"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1), (6, 2)], ids=["g1", "g4", "g8", "g3"])
def test_matches_reference(shape: tuple[list[int], list[int]], num_heads: int, num_kv_heads: int) -> None:
    out, expected = run_case(shape, num_heads, num_kv_heads, head_dim=32, block_size=8)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes_and_prefixes_crossing_pages(block_size: int) -> None:
    # prefix lengths just below, at and past page boundaries, chunks crossing into new pages
    shape = ([1, 6, 9, 1], [block_size + 1, block_size + 6, 3 * block_size - 2, 2 * block_size])
    out, expected = run_case(shape, 4, 2, head_dim=16, block_size=block_size)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-5)


def test_head_dim_not_a_power_of_two_and_padded_rows() -> None:
    out, expected = run_case(MIXED, 6, 3, head_dim=24, block_size=16, padded_rows=5)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("num_splits", [2, 4])
def test_split_kv_matches_reference(num_splits: int) -> None:
    # long contexts for few sequences (the flash-decoding case), some splits left empty
    shape = ([1, 1, 4], [150, 3, 130])
    out, expected = run_case(shape, 8, 2, head_dim=32, block_size=16, num_splits=num_splits, padded_rows=3)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-5)


def test_float16_close_to_float32_reference() -> None:
    out, expected = run_case(MIXED, 8, 2, head_dim=32, block_size=16, dtype=torch.float16)
    torch.testing.assert_close(out, expected, rtol=0, atol=5e-3)


def test_decode_rows_equal_the_decode_reference() -> None:
    """The same query rows as decode tokens give what the decode-only reference gives."""
    lens = DECODE_ONLY[1]
    kv, tables = make_paged(lens, 2, 16, 8, torch.float32, seed=3)
    query = torch.randn(len(lens), 4, 16, generator=torch.Generator().manual_seed(5))
    starts = torch.arange(len(lens) + 1)
    expected = paged_decode_attention(query, kv, tables, torch.tensor(lens), 0.25)
    args = (query, kv, starts, torch.tensor(lens), tables)
    out = unified.unified_attention(*(t.to(DEVICE) for t in args), 0.25)
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=2e-5)


def test_grid_bound_covers_every_split_of_the_tokens() -> None:
    """``num_tokens // BLOCK_Q + num_seqs`` programs suffice however the rows are split."""
    block_m, block_q = unified.block_shape(8, 2)
    assert (block_m, block_q) == (16, 4)
    for rows in ([1] * 9, [9], [3, 3, 3], [4, 1, 4], [5, 4]):
        needed = sum(-(-r // block_q) for r in rows)
        assert needed <= unified.grid_query_blocks(sum(rows), len(rows), 8, 2)


def test_refuses_bad_arguments() -> None:
    query = torch.zeros(2, 6, 16)
    kv = torch.zeros(4, 2, 8, 4, 16)
    with pytest.raises(ValueError, match="not a multiple"):
        unified.unified_attention(query, kv, torch.tensor([0, 2]), torch.tensor([2]), torch.zeros(1, 1), 1.0)
    with pytest.raises(ValueError, match="power of two"):
        kv = torch.zeros(4, 2, 8, 2, 16)
        unified.unified_attention(
            query, kv, torch.tensor([0, 2]), torch.tensor([2]), torch.zeros(1, 1), 1.0, num_splits=3
        )


def test_page_ids_outside_the_pool_are_refused_in_debug_mode() -> None:
    """The tests run with LORASERVE_CHECK_PAGE_IDS=1: a bad page id or slot fails before any launch."""
    from loraserve.kernels import page_checks, triton_rope_kv

    assert page_checks.ENABLED
    kv, tables = make_paged([5, 9], 2, 16, 8, torch.float32, seed=1)
    query = torch.zeros(2, 4, 16)
    bad = tables.clone()
    bad[1, 0] = kv.shape[0]
    with pytest.raises(ValueError, match=r"block_tables: .* outside"):
        unified.unified_attention(query, kv, torch.arange(3), torch.tensor([5, 9]), bad, 1.0)
    with pytest.raises(ValueError, match=r"seq_lens: .* outside"):
        unified.unified_attention(query, kv, torch.arange(3), torch.tensor([5, 99]), tables, 1.0)
    key = torch.zeros(2, 2, 16)
    cos = torch.ones(2, 16)
    with pytest.raises(ValueError, match=r"slot_mapping: .* outside"):
        triton_rope_kv.rope_write_kv(query, key, key.clone(), cos, cos, kv, torch.tensor([0, kv.shape[0] * 8]))
