"""The per-token-slot LoRA kernel (``kernels/triton_lora_slots.py``, the decode-graph path)
against ``lora_reference``, on the cases of the segment kernels (``kernel_cases.run_segments``:
adapters of ranks 1-64 on consecutive or scattered pages, modules absent in some adapters,
Punica's popularity patterns, base-model tokens left bit for bit), each segment's adapter given
a slot and every token its slot; plus ranks past one rank tile (128), slots in any order, and
tokens of padding (slot -1)."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from kernel_cases import BS, NUM_ADAPTERS, PAGE_ELEMS, POPULARITY, run_segments

slots_kernel = pytest.importorskip("loraserve.kernels.triton_lora_slots")
lora_tiles = pytest.importorskip("loraserve.kernels.triton_lora_tiles")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def slot_kernel(
    x: torch.Tensor,
    outputs: tuple[torch.Tensor, ...],
    storage: torch.Tensor,  # [L, P, E]
    layer: int,
    group: int,
    bounds: torch.Tensor,  # [S, 4]: segment s covers tokens start:end
    page_tables: torch.Tensor,  # [S, max_pages]
    meta: torch.Tensor,  # [L, G, S, 14]
    scales: torch.Tensor,  # [L, G, S, 3]
    reverse_slots: bool = False,
    dtype: torch.dtype = torch.float32,
    shuffle: bool = False,
    k_chunk: int | None = None,
) -> None:
    """``kernel_cases.SegmentsKernel`` over ``lora_slots``: segment ``s``'s adapter sits in slot ``s``
    (or, ``reverse_slots``, in slot ``S - 1 - s``), its tokens point at that slot; ``shuffle``
    permutes the tokens first (as a decode batch has them: one adapter's tokens interleaved with
    others'), and back after. ``k_chunk`` (default: one shrink tile, so inputs wider than a tile
    are summed over several chunks' partials)."""
    num_segments = bounds.shape[0]
    order = list(reversed(range(num_segments))) if reverse_slots else list(range(num_segments))
    token_slots = torch.full((x.shape[0],), -1, dtype=torch.long)
    for s, (start, end, _, _) in enumerate(bounds.tolist()):
        token_slots[start:end] = order[s]
    inverse = torch.tensor(order).argsort()  # slot -> segment
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(7)) if shuffle else None
    rows = perm if perm is not None else torch.arange(x.shape[0])
    on_device = tuple(out[rows].to(DEVICE, dtype) for out in outputs)
    if k_chunk is None:
        k_chunk = lora_tiles.shrink_width(x.shape[1], storage.shape[2], slots_kernel.SHRINK_WIDTHS)
    slots_kernel.lora_slots(
        x[rows].to(DEVICE, dtype),
        on_device,
        storage[layer].to(DEVICE, dtype),
        token_slots[rows].to(DEVICE),
        page_tables[inverse].contiguous().to(DEVICE),
        meta[layer, group][inverse].contiguous().to(DEVICE),
        scales[layer, group][inverse].contiguous().to(DEVICE),
        k_chunk=k_chunk,
    )
    for out, result in zip(outputs, on_device, strict=True):
        out[rows] = result.float().cpu()


@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive-pages", "scattered-pages"])
@pytest.mark.parametrize("pattern", list(POPULARITY))
def test_lora_slots_match_reference(pattern: str, scattered: bool) -> None:
    indices = POPULARITY[pattern](random.Random(pattern))
    run_segments(slot_kernel, indices, seed=len(pattern), scattered=scattered, layer=1)


def test_slots_in_any_order_and_skewed_sizes() -> None:
    reverse = functools.partial(slot_kernel, reverse_slots=True)
    run_segments(reverse, [5] + [11] * (BS - 1), seed=9, scattered=True, layer=0)
    run_segments(reverse, [*range(NUM_ADAPTERS), -1, -1], seed=4, scattered=False, layer=1)


@pytest.mark.parametrize("hidden, outs", [(37, (29, 5, 300)), (160, (130,))], ids=["odd", "one-output"])
def test_any_width_and_several_column_tiles(hidden: int, outs: tuple[int, ...]) -> None:
    indices = [0, 1, 1, 2, -1, 3, 3, 3, 7]
    run_segments(slot_kernel, indices, seed=5, scattered=True, layer=1, hidden=hidden, outs=outs)


@pytest.mark.parametrize(
    "hidden, outs", [(128, (128, 64, 64)), (64, (192, 32, 64)), (48, (128,))], ids=["both", "shrink", "expand"]
)
def test_aligned_tiles(hidden: int, outs: tuple[int, ...]) -> None:
    """Widths that are multiples of the tiles: each tile of a row read from one page
    (``triton_lora_tiles.aligned_tiles``; which loads are aligned is checked in test_triton_kernels)."""
    indices = [*POPULARITY["uniform"](random.Random(8)), -1, 3, 3]
    shuffled = functools.partial(slot_kernel, shuffle=True)
    run_segments(shuffled, indices, seed=8, scattered=True, layer=1, hidden=hidden, outs=outs)


@pytest.mark.parametrize("k_chunk", [64, 128, 512], ids=["3-chunks", "2-chunks", "1-chunk"])
def test_input_columns_split_into_chunks(k_chunk: int) -> None:
    """The shrink's partial sums over chunks of the input (the last one short), summed by the expand."""
    indices = [*POPULARITY["skewed"](random.Random(6)), -1, 2]
    chunked = functools.partial(slot_kernel, shuffle=True, k_chunk=k_chunk)
    run_segments(chunked, indices, seed=6, scattered=True, layer=1, hidden=160, outs=(130, 64))


def test_row_bound_and_chunk_checked() -> None:
    """A row bound below a slot's stacked rows, or a chunk not a multiple of the tile, is refused."""
    x = torch.randn(2, 64, device=DEVICE)
    out = torch.zeros(2, 64, device=DEVICE)
    meta = torch.zeros(1, 14, dtype=torch.long, device=DEVICE)
    meta[0, :6] = torch.tensor([0, 8, 0, 8, 8 * 64, 64])
    args = (x, (out,), torch.zeros(4, 1024, device=DEVICE), torch.tensor([0, 0], device=DEVICE),
            torch.zeros(1, 2, dtype=torch.long, device=DEVICE), meta, torch.ones(1, 1, device=DEVICE))  # fmt: skip
    with pytest.raises(ValueError, match="stacked rows"):
        slots_kernel.lora_slots(*args, row_bound=4)
    with pytest.raises(ValueError, match="k_chunk must be a positive multiple of 64"):
        slots_kernel.lora_slots(*args, k_chunk=96)
    slots_kernel.lora_slots(*args, row_bound=64)  # a bound above the rows: programs past them return
    assert not out.any()  # zero weights: nothing added


@pytest.mark.parametrize("hidden, width", [(512, 256), (384, 128)])
def test_wide_shrink_tiles(monkeypatch: pytest.MonkeyPatch, hidden: int, width: int) -> None:
    """Shrink tiles of 256 or 128 input columns (``WIDE_SHRINK_WIDTHS``), as runs of 64 from their pages."""
    monkeypatch.setattr(slots_kernel, "SHRINK_WIDTHS", slots_kernel.triton_lora.WIDE_SHRINK_WIDTHS)
    assert lora_tiles.shrink_width(hidden, PAGE_ELEMS, slots_kernel.SHRINK_WIDTHS) == width
    indices = [*POPULARITY["uniform"](random.Random(8)), -1, 3, 3]
    shuffled = functools.partial(slot_kernel, shuffle=True)
    run_segments(shuffled, indices, seed=8, scattered=True, layer=1, hidden=hidden, outs=(64, 128))


def test_float16_close_to_float32_reference() -> None:
    indices = POPULARITY["skewed"](random.Random(1))[:12]
    fp16 = functools.partial(slot_kernel, dtype=torch.float16)
    run_segments(fp16, indices, seed=2, scattered=True, layer=1, atol=2e-2, dtype=torch.float16)


@pytest.mark.parametrize("rank", [1, 3, 128])
def test_any_rank_crossing_rank_tiles_and_pages(rank: int) -> None:
    """One adapter of rank 1, 3 (less than a rank tile) or 128 (eight tiles), its rows crossing
    pages, against a plain product."""
    hidden, out_features, page_elems = 40, 70, 256
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(rank, hidden, generator=gen) / hidden**0.5
    bt = torch.randn(rank, out_features, generator=gen) / rank**0.5
    flat = torch.cat([a.reshape(-1), bt.reshape(-1)])
    num_pages = -(-flat.numel() // page_elems)
    pages = torch.randperm(num_pages + 3, generator=gen)[:num_pages]
    weights = torch.zeros(num_pages + 3, page_elems)
    padded = torch.zeros(num_pages * page_elems)
    padded[: flat.numel()] = flat
    weights[pages] = padded.view(num_pages, page_elems)
    meta = torch.zeros(1, 14, dtype=torch.long)
    meta[0, :6] = torch.tensor([0, rank, 0, rank, a.numel(), out_features])
    x = torch.randn(3, hidden, generator=gen)
    out = torch.zeros(3, out_features)
    on_device = (out.to(DEVICE),)
    slots_kernel.lora_slots(
        x.to(DEVICE),
        on_device,
        weights.to(DEVICE),
        torch.tensor([0, -1, 0], device=DEVICE),
        pages[None].to(DEVICE),
        meta.to(DEVICE),
        torch.tensor([[0.5]], device=DEVICE),
    )
    expected = 0.5 * (x @ a.T) @ bt
    expected[1] = 0
    torch.testing.assert_close(on_device[0].cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern", ["uniform", "distinct", "with-base"])
def test_tokens_of_a_slot_interleaved_with_others(pattern: str) -> None:
    """A decode batch's order: each adapter's tokens scattered among the others' (and the base's)."""
    indices = POPULARITY[pattern](random.Random(pattern))
    shuffled = functools.partial(slot_kernel, shuffle=True)
    run_segments(shuffled, indices, seed=3, scattered=True, layer=1)


def test_sort_by_slot_groups_tokens_and_counts_tiles() -> None:
    from loraserve.kernels.lora import SLOT_TILE, sort_by_slot

    token_slots = torch.tensor([2, -1, 0, 2, 2, -1, 0] + [1] * (SLOT_TILE + 1))
    grouping = sort_by_slot(token_slots, num_slots=4)
    assert grouping.order[:2].tolist() == [1, 5]  # base-model tokens first, in their order
    assert grouping.order[2:4].tolist() == [2, 6]  # slot 0, stable
    assert grouping.order[-3:].tolist() == [0, 3, 4]  # slot 2; slot 3 has none
    assert grouping.starts.tolist() == [2, 4, 4 + SLOT_TILE + 1, 4 + SLOT_TILE + 4, 4 + SLOT_TILE + 4]
    assert grouping.tile_ends.tolist() == [1, 3, 4, 4]  # slot 1's 17 tokens take two tiles
