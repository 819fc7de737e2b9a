"""The CPU gathered-LoRA path (``apply_lora_segments``) against the float32 per-token reference.

Punica-style adapter popularity patterns (distinct, uniform, skewed, identical), skewed segment
sizes (1 and bs-1), mixed ranks 1..64 in one batch, base-model tokens left bit-for-bit untouched,
and the fused q/k/v group (one stacked shrink, three outputs at column offsets). Also the merging
of per-sequence ranges into segments (``LoRABatch.from_runs``).
"""

from __future__ import annotations

import importlib.util
import math
import random

import numpy as np
import pytest
import torch
from loraserve.kernels.lora import LoRASegment, OutputSlice, apply_lora_segments, lora_reference

from loraserve.lora.batch import AdapterPages, LoRABatch
from loraserve.lora.layout import AdapterLayout

IN, OUT, BS, NUM_ADAPTERS = 96, 80, 33, 64
RANKS = list(range(1, NUM_ADAPTERS + 1))  # adapter i has rank i + 1: every rank 1..64 in one pool


def make_adapters(
    ranks: list[int], in_features: int, out_features: int, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """Random A ``[r, in]``, B ``[out, r]`` and scale per adapter."""
    gen = torch.Generator().manual_seed(seed)
    a = [torch.randn(r, in_features, generator=gen) / math.sqrt(in_features) for r in ranks]
    b = [torch.randn(out_features, r, generator=gen) / math.sqrt(r) for r in ranks]
    scales = [0.25 + 2.0 * float(torch.rand(1, generator=gen)) for _ in ranks]
    return a, b, scales


def segments_of(indices: list[int], a: list[torch.Tensor], b: list[torch.Tensor], scales: list[float]) -> list:
    """One segment per run of equal adapter index (runs of -1 are base-model tokens: no segment)."""
    segments: list[LoRASegment] = []
    start = 0
    for t in range(1, len(indices) + 1):
        if t == len(indices) or indices[t] != indices[start]:
            i = indices[start]
            if i >= 0:
                segments.append(LoRASegment(start, t, a[i], (OutputSlice(0, a[i].shape[0], b[i].T, scales[i]),)))
            start = t
    return segments


def check(indices: list[int], seed: int = 0, dtype: torch.dtype = torch.float32, atol: float = 1e-5) -> None:
    a, b, scales = make_adapters(RANKS, IN, OUT, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(len(indices), IN, generator=gen)
    base = torch.randn(len(indices), OUT, generator=gen)
    out = base.to(dtype).clone()
    cast = [t.to(dtype) for t in a], [t.to(dtype) for t in b]
    apply_lora_segments(x.to(dtype), (out,), segments_of(indices, *cast, scales))
    expected = base + lora_reference(x, torch.tensor(indices), a, b, scales)
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=atol)
    untouched = [t for t, i in enumerate(indices) if i < 0]
    assert torch.equal(out[untouched], base.to(dtype)[untouched])


def zipf_indices(n: int, alpha: float, rng: random.Random) -> list[int]:
    weights = [1 / (k + 1) ** alpha for k in range(NUM_ADAPTERS)]
    return rng.choices(range(NUM_ADAPTERS), weights, k=n)


POPULARITY = {
    "distinct": lambda rng: rng.sample(range(NUM_ADAPTERS), BS),
    "uniform": lambda rng: rng.choices(rng.sample(range(NUM_ADAPTERS), math.isqrt(BS)), k=BS),
    "skewed": lambda rng: zipf_indices(BS, 1.5, rng),
    "identical": lambda rng: [rng.randrange(NUM_ADAPTERS)] * BS,
}


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "interleaved"])
@pytest.mark.parametrize("pattern", list(POPULARITY))
def test_popularity_patterns(pattern: str, grouped: bool) -> None:
    """Tokens grouped by adapter (as the runner orders them), or interleaved (many short segments)."""
    indices = POPULARITY[pattern](random.Random(pattern))
    check(sorted(indices) if grouped else indices)


@pytest.mark.parametrize(
    "indices",
    [[5] + [63] * (BS - 1), [63] * (BS - 1) + [0], [-1] + [7] * (BS - 1), [7] * (BS - 1) + [-1], [0], [63]],
    ids=["1+bs-1", "bs-1+1", "base+bs-1", "bs-1+base", "one-token-rank1", "one-token-rank64"],
)
def test_skewed_segment_sizes(indices: list[int]) -> None:
    check(indices)


def test_mixed_ranks_and_base_tokens_in_one_batch() -> None:
    rng = random.Random(3)
    indices = [rng.choice([-1, *range(NUM_ADAPTERS)]) for _ in range(4 * NUM_ADAPTERS)]
    indices[:3] = [-1, 0, NUM_ADAPTERS - 1]  # rank 1 and rank 64 present, and a base token
    check(indices, seed=3)
    check([-1] * 5)  # no adapter at all: nothing changes


def test_low_precision_storage() -> None:
    check(sorted(zipf_indices(BS, 1.0, random.Random(5))), dtype=torch.bfloat16, atol=0.08)


def test_fused_qkv_group_equals_separate_modules() -> None:
    """One shrink over stacked [A_q; A_k; A_v] (views into a flat buffer, as read from pages) and
    per-module expands at column offsets equal three separate per-module references."""
    hidden, outs = 64, {"q": 64, "k": 32, "v": 32}
    # Per adapter: the rank of each module, 0 where the adapter does not target it.
    module_ranks = [
        {"q": 8, "k": 8, "v": 8},
        {"q": 64, "k": 0, "v": 3},
        {"q": 0, "k": 1, "v": 0},
        {"q": 5, "k": 17, "v": 33},
    ]
    gen = torch.Generator().manual_seed(0)
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = []
    segments_by_adapter: list[tuple[torch.Tensor, tuple[OutputSlice | None, ...]]] = []
    for ranks in module_ranks:
        total = sum(ranks.values())
        buffer = torch.zeros(total * hidden + sum(r * outs[m] for m, r in ranks.items()) + 7)
        stacked = buffer[: total * hidden].view(total, hidden)
        offset, column, slices, adapter = total * hidden, 0, [], {}
        for module, rank in ranks.items():
            if rank == 0:
                slices.append(None)
                continue
            a = torch.randn(rank, hidden, generator=gen)
            b = torch.randn(outs[module], rank, generator=gen) * 0.1
            scale = float(torch.rand(1, generator=gen)) + 0.5
            stacked[column : column + rank] = a
            b_t = buffer[offset : offset + rank * outs[module]].view(rank, outs[module])
            b_t.copy_(b.T)
            slices.append(OutputSlice(column, rank, b_t, scale))
            adapter[module] = (a, b, scale)
            offset, column = offset + rank * outs[module], column + rank
        weights.append(adapter)
        segments_by_adapter.append((stacked, tuple(slices)))
    indices = [0, 0, 1, -1, 2, 2, 2, 3, 1, 1, 3]
    x = torch.randn(len(indices), hidden, generator=gen)
    bases = {m: torch.randn(len(indices), o, generator=gen) for m, o in outs.items()}
    outputs = tuple(base.clone() for base in bases.values())
    segments = [
        LoRASegment(start, end, *segments_by_adapter[i])
        for start, end, i in [(0, 2, 0), (2, 3, 1), (4, 7, 2), (7, 8, 3), (8, 10, 1), (10, 11, 3)]
    ]
    apply_lora_segments(x, outputs, segments)
    for (module, base), out in zip(bases.items(), outputs, strict=True):
        has = [module in w for w in weights]
        per_module = torch.tensor([i if i >= 0 and has[i] else -1 for i in indices])
        dummy = (torch.zeros(1, hidden), torch.zeros(outs[module], 1), 0.0)
        a, b, scales = zip(*[w.get(module, dummy) for w in weights], strict=True)
        expected = base + lora_reference(x, per_module, list(a), list(b), list(scales))
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
        assert torch.equal(out[per_module < 0], base[per_module < 0])


@pytest.mark.parametrize(
    ("adapter_ids", "token_ends", "expected"),
    [
        (["a", "a", "b"], [2, 5, 6], ((0, 5, "a"), (5, 6, "b"))),
        (["a", "b", "a"], [1, 2, 3], ((0, 1, "a"), (1, 2, "b"), (2, 3, "a"))),
        (["a", None, "a"], [2, 3, 4], ((0, 2, "a"), (3, 4, "a"))),  # base tokens split a run
        ([None, "c", "c", "c"], [3, 4, 9, 10], ((3, 10, "c"),)),
        (["b"], [7], ((0, 7, "b"),)),
    ],
)
def test_lora_batch_from_runs_makes_one_segment_per_run_of_an_adapter(
    adapter_ids: list[str | None], token_ends: list[int], expected: tuple[tuple[int, int, str], ...]
) -> None:
    pages = {name: AdapterPages(name, (i,), AdapterLayout((), ())) for i, name in enumerate("abcd")}
    batch = LoRABatch.from_runs(adapter_ids, np.array(token_ends), pages)
    assert batch is not None and batch.segments == expected
    assert batch.adapter_ids == {adapter_id for _, _, adapter_id in expected} == set(batch.adapters)
    assert all(batch.adapters[a] is pages[a] for a in batch.adapters)


def test_lora_batch_from_runs_without_adapters_is_none() -> None:
    assert LoRABatch.from_runs([], np.zeros(0, np.int64), {}) is None
    assert LoRABatch.from_runs([None, None], np.array([4, 5]), {}) is None


def test_the_segment_meta_layout_is_defined_once_and_mirrored() -> None:
    """kernels/lora.py's SegmentMeta is what the C++ kernel and the Triton kernels read."""
    from loraserve.kernels import cpu
    from loraserve.kernels.lora import SegmentMeta

    from loraserve.lora.apply_cpu import META_WIDTH

    assert SegmentMeta.WIDTH == META_WIDTH == 14
    extension = cpu.load_extension()
    if extension is not None:
        mirrored = [SegmentMeta.WIDTH, SegmentMeta.MAX_MODULES, SegmentMeta.MODULE_BASE, SegmentMeta.MODULE_STRIDE]
        assert list(extension.lora_meta_layout()) == mirrored
    if importlib.util.find_spec("triton") is not None:
        from loraserve.kernels import triton_lora_tiles

        names = ("A_OFFSET", "NUM_ROWS", "MODULE_BASE", "MODULE_STRIDE", "COLUMN", "RANK", "B_OFFSET", "OUT_FEATURES")
        for name in names:
            assert getattr(triton_lora_tiles, f"META_{name}").value == getattr(SegmentMeta, name)


def test_segment_packer_gathers_each_adapters_rows_across_moves_and_restarts() -> None:
    """``SegmentPacker.pack`` against each segment's own ``layout_meta`` and pages, over steps that
    see 150 adapters (so its rows start over several times) and move some adapters' pages."""
    from loraserve.lora.apply_cpu import SegmentPacker, layout_meta
    from loraserve.lora.layout import GroupSlot, ModuleSlot

    def layout(i: int) -> AdapterLayout:
        rank = 1 + i % 5
        module = ModuleSlot("o_proj", rank, 8, 8, a_offset=i, b_offset=1000 + i, column=0, scale=i / 10)
        return AdapterLayout(({"o": GroupSlot(i, rank, 8, (module,))},), (1000 + i + 8 * rank,))

    rng = random.Random(5)
    pages = {f"a{i}": AdapterPages(f"a{i}", tuple(range(100 * i, 100 * i + 1 + i % 3)), layout(i)) for i in range(150)}
    packer = SegmentPacker(num_layers=1, page_elems=10)
    for step in range(60):
        names = rng.sample(sorted(pages), rng.randint(1, 40))
        if step % 7 == 0:  # evicted and loaded again elsewhere, on scattered pages
            pages[names[0]] = AdapterPages(names[0], (9000 + step, 3), pages[names[0]].layout)
        segments = tuple((2 * k, 2 * k + 2, name) for k, name in enumerate(names))
        bounds, tables, meta, scales = packer.pack(LoRABatch(segments, {name: pages[name] for name in names}))
        assert tables.shape[1] == max(len(pages[name].page_ids) for name in names)
        for k, name in enumerate(names):
            ids = pages[name].page_ids
            assert tables[k, : len(ids)].tolist() == list(ids) and not tables[k, len(ids) :].any()
            consecutive = ids == tuple(range(ids[0], ids[0] + len(ids)))
            assert bounds[k].tolist() == [2 * k, 2 * k + 2, 0 if consecutive else 1, ids[0] * 10 if consecutive else 0]
            expected_meta, expected_scales = layout_meta(pages[name].layout)  # [L, G, 14], [L, G, 3]
            assert torch.equal(meta[:, :, k], expected_meta) and torch.equal(scales[:, :, k], expected_scales)
