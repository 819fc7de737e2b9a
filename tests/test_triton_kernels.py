"""The Triton kernels against the torch references.

On a CUDA machine they run compiled on the GPU; elsewhere (CI) under Triton's interpreter,
which ``conftest.py`` switches on before the kernels are imported, on the small shapes of
``kernel_cases.py``: GQA/MHA/MQA paged decode attention over shuffled pages, and segmented
LoRA over adapters of mixed ranks on consecutive or scattered pages, under Punica's
adapter popularity patterns.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from kernel_cases import (
    ATTENTION_CASES,
    ATTENTION_IDS,
    BS,
    HIDDEN,
    PAGE_ELEMS,
    POPULARITY,
    decode_case,
    make_paged,
    run_segments,
)
from loraserve.kernels.paged_attention import paged_decode_attention

triton_attention = pytest.importorskip("loraserve.kernels.triton_attention")
triton_lora = pytest.importorskip("loraserve.kernels.triton_lora")
triton_lora_tiles = pytest.importorskip("loraserve.kernels.triton_lora_tiles")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_kernels_run_where_they_can() -> None:
    """Compiled on a GPU, interpreted elsewhere: never silently skipped on a CPU machine."""
    assert triton_attention.runs_interpreted() == (DEVICE.type == "cpu")


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), ATTENTION_CASES, ids=ATTENTION_IDS)
def test_decode_attention_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    query, kv, tables, context_lens, scale = decode_case(num_heads, num_kv_heads, head_dim, block_size)
    expected = paged_decode_attention(query, kv, tables, context_lens, scale)
    out = triton_attention.paged_decode_attention(
        query.to(DEVICE), kv.to(DEVICE), tables.to(DEVICE), context_lens.to(DEVICE), scale
    )
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=1e-5)


def test_decode_attention_bfloat16_close_to_float32_reference() -> None:
    lens = [5, 40, 129]
    kv, tables = make_paged(lens, 2, 32, 16, torch.bfloat16, seed=7)
    query = torch.randn(len(lens), 6, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    expected = paged_decode_attention(query.float(), kv.float(), tables, torch.tensor(lens), 0.2)
    out = triton_attention.paged_decode_attention(
        query.to(DEVICE), kv.to(DEVICE), tables.to(DEVICE), torch.tensor(lens, device=DEVICE), 0.2
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), expected, rtol=0, atol=2e-2)


def triton_segments(
    x: torch.Tensor,
    outputs: tuple[torch.Tensor, ...],
    storage: torch.Tensor,  # [L, P, E]
    layer: int,
    group: int,
    bounds: torch.Tensor,
    page_tables: torch.Tensor,
    meta: torch.Tensor,  # [L, G, S, 14]
    scales: torch.Tensor,  # [L, G, S, 3]
    dtype: torch.dtype = torch.float32,
) -> None:
    """``kernel_cases.SegmentsKernel`` over ``triton_lora.lora_segments`` on ``DEVICE``, in ``dtype``."""
    on_device = tuple(out.to(DEVICE, dtype) for out in outputs)
    triton_lora.lora_segments(
        x.to(DEVICE, dtype),
        on_device,
        storage[layer].to(DEVICE, dtype),
        bounds.to(DEVICE),
        page_tables.to(DEVICE),
        meta[layer, group].contiguous().to(DEVICE),
        scales[layer, group].contiguous().to(DEVICE),
        int((bounds[:, 1] - bounds[:, 0]).max()),
        int(meta[layer, group, :, 1].max()),
    )
    for out, result in zip(outputs, on_device, strict=True):
        out.copy_(result.float().cpu())


@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive-pages", "scattered-pages"])
@pytest.mark.parametrize("pattern", list(POPULARITY))
def test_lora_segments_match_reference(pattern: str, scattered: bool) -> None:
    indices = POPULARITY[pattern](random.Random(pattern))
    run_segments(triton_segments, sorted(indices), seed=len(pattern), scattered=scattered, layer=1)
    run_segments(triton_segments, indices, seed=3, scattered=scattered, layer=0)


@pytest.mark.parametrize(
    "indices", [[5] + [11] * (BS - 1), [11] * (BS - 1) + [0], [3]], ids=["1+bs-1", "bs-1+1", "one"]
)
def test_lora_segments_skewed_sizes(indices: list[int]) -> None:
    run_segments(triton_segments, indices, seed=9, scattered=False, layer=0)
    run_segments(triton_segments, indices, seed=9, scattered=True, layer=1)


@pytest.mark.parametrize("hidden, outs", [(37, (29, 5, 70)), (HIDDEN, (130,))], ids=["odd", "one-output"])
def test_lora_segments_any_width_and_tile_remainders(hidden: int, outs: tuple[int, ...]) -> None:
    """Segments of 1-5, 16 (one token tile), 17 and 33 tokens; widths that are not multiples of
    any tile, and several column tiles per module."""
    indices = [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, -1] + [5] * 16 + [6] * 17 + [7] * 33
    run_segments(triton_segments, indices, seed=5, scattered=True, layer=1, hidden=hidden, outs=outs)


@pytest.mark.parametrize(
    "hidden, outs, expected",
    [(128, (128, 64, 64), (True, True)), (64, (192, 32, 64), (True, False)), (48, (128,), (False, True))],
    ids=["aligned", "aligned-shrink-only", "aligned-expand-only"],
)
@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive-pages", "scattered-pages"])
def test_lora_segments_aligned_tiles(hidden: int, outs: tuple[int, ...], expected: tuple, scattered: bool) -> None:
    """Widths that are multiples of the tiles: the kernels load each tile of a row from one page
    (``aligned_tiles``), here over rows that start mid-page and adapters on several pages."""
    x, meta = torch.zeros(1, hidden), torch.zeros(1, 14, dtype=torch.long)
    widths = (triton_lora_tiles.shrink_width(hidden, PAGE_ELEMS, triton_lora.SHRINK_WIDTHS), triton_lora.EXPAND_BLOCK_N)
    outputs = tuple(torch.zeros(1, out) for out in outs)
    assert triton_lora_tiles.alignment("test", x, outputs, PAGE_ELEMS, meta, widths) == expected
    indices = POPULARITY["skewed"](random.Random(4)) + [-1, 2, 2] + [5] * 17
    run_segments(triton_segments, indices, seed=6, scattered=scattered, layer=1, hidden=hidden, outs=outs)


@pytest.mark.parametrize("hidden, width", [(512, 256), (384, 128)])
def test_lora_segments_wide_shrink_tiles(monkeypatch: pytest.MonkeyPatch, hidden: int, width: int) -> None:
    """Shrink tiles wider than ``WEIGHT_ALIGN`` (``WIDE_SHRINK_WIDTHS``): each row's tile loaded as
    runs of 64 columns, each from its own page, over rows that start mid-page."""
    monkeypatch.setattr(triton_lora, "SHRINK_WIDTHS", triton_lora.WIDE_SHRINK_WIDTHS)
    assert triton_lora_tiles.shrink_width(hidden, PAGE_ELEMS, triton_lora.SHRINK_WIDTHS) == width
    indices = POPULARITY["skewed"](random.Random(4)) + [-1, 2, 2] + [5] * 17
    run_segments(triton_segments, indices, seed=6, scattered=True, layer=1, hidden=hidden, outs=(64, 128))


def test_aligned_loads_refuse_misaligned_offsets_in_debug_mode() -> None:
    """The aligned loads rely on lora/layout.py's alignment; the debug mode checks it."""
    meta = torch.zeros(2, 14, dtype=torch.long)
    meta[1, 0] = 64 * 3 + 8  # a group's A not at a multiple of WEIGHT_ALIGN
    args = ("lora_segments", torch.zeros(1, 64), (torch.zeros(1, 64),), PAGE_ELEMS, meta, (64, 64))
    with pytest.raises(ValueError, match="A offsets: 200 is not a multiple of 64"):
        triton_lora_tiles.alignment(*args)
    meta[1, 0], meta[0, 4] = 0, 96  # module 0's B^T
    with pytest.raises(ValueError, match="B offsets: 96"):
        triton_lora_tiles.alignment(*args)


def test_lora_segments_bfloat16_close_to_float32_reference() -> None:
    indices = POPULARITY["skewed"](random.Random(1))
    bf16 = functools.partial(triton_segments, dtype=torch.bfloat16)
    run_segments(bf16, sorted(indices), seed=2, scattered=True, layer=1, atol=0.1, dtype=torch.bfloat16)
