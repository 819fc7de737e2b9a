"""The compiled CPU kernels (``kernels/cpu.py``) against the torch references.

Paged decode attention: GQA and MHA, scattered pages, contexts of 1 token, exact
multiples of the block size and padded block tables, float32 and bfloat16. Segmented
LoRA: adapters of mixed ranks laid out in pool pages as ``adapter_layout.py`` does
(stacked A rows, then B^T per module, modules absent in some adapters), on consecutive
pages (read in place) or scattered ones (followed through page tables), under Punica's
adapter popularity patterns.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from loraserve.kernels import cpu
from loraserve.kernels.lora import lora_reference
from loraserve.kernels.paged_attention import paged_decode_attention, write_kv

pytestmark = pytest.mark.skipif(cpu.load_extension() is None, reason="the C++ CPU kernels could not be built")


def make_paged(
    lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages with random K/V and block tables on shuffled page ids, padded with page 0."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    num_pages = sum(blocks) + 5
    kv = torch.randn(num_pages, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_pages, generator=gen).tolist()
    tables, used = [], 0
    for count in blocks:
        tables.append(ids[used : used + count] + [0] * (max(blocks) - count))
        used += count
    return kv, torch.tensor(tables, dtype=torch.long)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 16, 4)],
    ids=["gqa3", "mha", "mqa"],
)
def test_decode_attention_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    lens = [1, block_size, block_size + 1, 3 * block_size, 77, 2]
    kv, tables = make_paged(lens, num_kv_heads, head_dim, block_size, torch.float32, seed=num_heads)
    query = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    context_lens = torch.tensor(lens)
    scale = head_dim**-0.5
    expected = paged_decode_attention(query, kv, tables, context_lens, scale)
    out = cpu.paged_decode_attention(query, kv, tables, context_lens, scale)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-6)


def test_decode_attention_bfloat16_close_to_float32_reference() -> None:
    lens = [5, 40, 129]
    kv, tables = make_paged(lens, 2, 32, 16, torch.bfloat16, seed=7)
    query = torch.randn(len(lens), 6, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    expected = paged_decode_attention(query.float(), kv.float(), tables, torch.tensor(lens), 0.2)
    out = cpu.paged_decode_attention(query, kv, tables, torch.tensor(lens), 0.2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn(7, 2, 4, 3, 8, generator=gen).to(dtype)
    key, value = (torch.randn(10, 3, 8, generator=gen).to(dtype) for _ in range(2))
    slots = torch.randperm(28, generator=gen)[:10]  # distinct slots over every page
    expected = kv.clone()
    write_kv(expected, key, value, slots)
    cpu.write_kv_(kv, key, value, slots)
    assert torch.equal(kv, expected)
    with pytest.raises(RuntimeError, match="outside the pages"):
        cpu.write_kv_(kv, key[:1], value[:1], torch.tensor([28]))


# ---- segmented LoRA --------------------------------------------------------------------
HIDDEN, OUTS = 48, (48, 16, 16)  # a q/k/v-like group: three outputs of one input
NUM_ADAPTERS, BS, PAGE_ELEMS, NUM_LAYERS = 12, 29, 256, 2


def random_adapters(
    seed: int, hidden: int = HIDDEN, outs: tuple[int, ...] = OUTS
) -> list[list[tuple[torch.Tensor, torch.Tensor, float] | None]]:
    """Per adapter, per module: (A [r, in], B [out, r], scale) or None (module not adapted)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    adapters = []
    for i in range(NUM_ADAPTERS):
        modules: list[tuple[torch.Tensor, torch.Tensor, float] | None] = []
        for m, out in enumerate(outs):
            if i % 4 == 3 and m == 1:
                modules.append(None)  # some adapters do not target every module
                continue
            rank = rng.choice([1, 4, 8, 16, 33, 64])
            a = torch.randn(rank, hidden, generator=gen) / math.sqrt(hidden)
            b = torch.randn(out, rank, generator=gen) / math.sqrt(rank)
            modules.append((a, b, rng.uniform(0.25, 2.0)))
        adapters.append(modules)
    return adapters


def pack(
    adapters: list, scattered: bool, seed: int, outs: tuple[int, ...] = OUTS
) -> tuple[torch.Tensor, list[list[int]], torch.Tensor]:
    """Lay adapters out in storage ``[L, P, E]`` as adapter_layout.py does (layer l holds weights * (l + 1)).

    Each adapter gets consecutive pages, or (``scattered``) pages in shuffled order across the
    pool. Returns the storage, each adapter's page ids and ``meta [L, 1, NUM_ADAPTERS, 14]``.
    """
    flats, metas = [], []
    for modules in adapters:
        a_rows = [mod[0] for mod in modules if mod is not None]
        flat, meta, column = [torch.cat(a_rows).reshape(-1)], [0, sum(a.shape[0] for a in a_rows)], 0
        offset = flat[0].numel()
        for mod, out in zip(modules, outs, strict=True):
            if mod is None:
                meta += [0, 0, 0, 0]
                continue
            rank = mod[0].shape[0]
            meta += [column, rank, offset, out]
            flat.append(mod[1].T.reshape(-1))
            column, offset = column + rank, offset + rank * out
        flats.append(torch.cat(flat))
        metas.append(meta)
    counts = [-(-flat.numel() // PAGE_ELEMS) for flat in flats]
    num_pages = sum(counts) + 1  # page 0 stays unused
    ids = list(range(1, num_pages))
    if scattered:
        random.Random(seed).shuffle(ids)
    page_ids, used = [], 0
    for count in counts:
        page_ids.append(ids[used : used + count])
        used += count
    storage = torch.full((NUM_LAYERS, num_pages, PAGE_ELEMS), float("nan"))
    for layer in range(NUM_LAYERS):
        for flat, pages in zip(flats, page_ids, strict=True):
            padded = torch.full((len(pages) * PAGE_ELEMS,), float("nan"))
            padded[: flat.numel()] = flat * (layer + 1)
            storage[layer, pages] = padded.view(len(pages), PAGE_ELEMS)
    meta = torch.tensor(metas, dtype=torch.long)[None, None].expand(NUM_LAYERS, 1, -1, -1).contiguous()
    return storage, page_ids, meta


def run_segments(
    indices: list[int], seed: int, scattered: bool, layer: int, hidden: int = HIDDEN, outs: tuple[int, ...] = OUTS
) -> None:
    adapters = random_adapters(seed, hidden, outs)
    storage, page_ids, meta_all = pack(adapters, scattered, seed, outs)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(len(indices), hidden, generator=gen)
    bases = [torch.randn(len(indices), out, generator=gen) for out in outs]
    runs = []  # (start, end, adapter) per run of one adapter, base-model runs dropped
    start = 0
    for t in range(1, len(indices) + 1):
        if t == len(indices) or indices[t] != indices[start]:
            if indices[start] >= 0:
                runs.append((start, t, indices[start]))
            start = t
    if scattered:
        bounds = torch.tensor([(s, e, 1, 0) for s, e, _ in runs], dtype=torch.long)
    else:
        bounds = torch.tensor([(s, e, 0, page_ids[i][0] * PAGE_ELEMS) for s, e, i in runs], dtype=torch.long)
    width = max(len(pages) for pages in page_ids)
    tables = torch.tensor([page_ids[i] + [0] * (width - len(page_ids[i])) for _, _, i in runs], dtype=torch.long)
    tables = tables.view(len(runs), width)
    meta = meta_all[:, :, [i for _, _, i in runs]].contiguous()
    scales = torch.tensor([[0.0 if m is None else m[2] for m in adapters[i]] for _, _, i in runs])
    scales = scales[None, None].expand(NUM_LAYERS, 1, -1, -1).contiguous()
    outputs = tuple(base.clone() for base in bases)
    if runs:
        cpu.lora_segments(x, outputs, storage, layer, 0, bounds, tables, meta, scales)
    for m, (base, out) in enumerate(zip(bases, outputs, strict=True)):
        has = [adapter[m] is not None for adapter in adapters]
        per_module = torch.tensor([i if i >= 0 and has[i] else -1 for i in indices])
        dummy = (torch.zeros(1, hidden), torch.zeros(outs[m], 1), 0.0)
        a, b, s = zip(*[adapter[m] or dummy for adapter in adapters], strict=True)
        factor = layer + 1  # both A and B of layer l were stored times (l + 1)
        expected = base + lora_reference(x, per_module, [t * factor for t in a], [t * factor for t in b], list(s))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[per_module < 0], base[per_module < 0])  # base tokens bit for bit


POPULARITY = {
    "distinct": lambda rng: rng.sample(range(NUM_ADAPTERS), NUM_ADAPTERS),
    "uniform": lambda rng: rng.choices(range(NUM_ADAPTERS), k=BS),
    "skewed": lambda rng: rng.choices(range(NUM_ADAPTERS), [1 / (k + 1) ** 1.5 for k in range(NUM_ADAPTERS)], k=BS),
    "identical": lambda rng: [rng.randrange(NUM_ADAPTERS)] * BS,
    "with-base": lambda rng: rng.choices([-1, *range(NUM_ADAPTERS)], k=BS),
}


@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive-pages", "scattered-pages"])
@pytest.mark.parametrize("pattern", list(POPULARITY))
def test_lora_segments_match_reference(pattern: str, scattered: bool) -> None:
    """Grouped by adapter (segments long enough for MKL) and interleaved (1-2 token GEMV loops)."""
    indices = POPULARITY[pattern](random.Random(pattern))
    run_segments(sorted(indices), seed=len(pattern), scattered=scattered, layer=1)
    run_segments(indices, seed=3, scattered=scattered, layer=0)


@pytest.mark.parametrize(
    "indices", [[5] + [11] * (BS - 1), [11] * (BS - 1) + [0], [-1] * 4, [3]], ids=["1+bs-1", "bs-1+1", "base", "one"]
)
def test_lora_segments_skewed_sizes(indices: list[int]) -> None:
    run_segments(indices, seed=9, scattered=False, layer=0)
    run_segments(indices, seed=9, scattered=True, layer=1)


@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive-pages", "scattered-pages"])
@pytest.mark.parametrize("hidden, outs", [(37, (29, 5, 70)), (576, (192, 17, 1536))], ids=["odd", "wide"])
def test_lora_segments_tiled_and_mkl_paths_on_any_width(hidden: int, outs: tuple[int, ...], scattered: bool) -> None:
    """Segments of 1-5 tokens (every token-block remainder), 32 (the largest tiled one) and 33
    (MKL), on widths that are not multiples of the vector width (scalar tails) and wide ones
    (several expand work items per module)."""
    indices = [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, -1, 5] + [6] * 32 + [7] * 33
    run_segments(indices, seed=5, scattered=scattered, layer=1, hidden=hidden, outs=outs)


def test_lora_segments_refuse_other_dtypes() -> None:
    x = torch.zeros(2, HIDDEN, dtype=torch.bfloat16)
    meta = torch.zeros(1, 1, 1, 14, dtype=torch.long)
    with pytest.raises(RuntimeError, match="float32 only"):
        cpu.lora_segments(
            x, (torch.zeros(2, 4),), torch.zeros(1, 1, 8), 0, 0,
            torch.tensor([[0, 2, 0, 0]]), torch.zeros(1, 0, dtype=torch.long), meta, torch.zeros(1, 1, 1, 3),
        )  # fmt: skip


# ---- fused elementwise ops ---------------------------------------------------------------
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
    from loraserve.models.llama import apply_rope

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(23, 6, 64, generator=gen)
    angles = torch.rand(23, 32, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)  # [num_tokens, head_dim], as RotaryEmbedding builds it
    cos, sin = emb.cos() * 1.1, emb.sin() * 1.1
    expected = apply_rope(x, cos, sin)
    cpu.rope_(x, cos, sin)
    assert torch.equal(x, expected)
