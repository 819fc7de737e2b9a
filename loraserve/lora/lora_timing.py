"""The timed passes behind ``lora/tile_choice.py``: the ways the compiled CPU kernel can run LoRA
segments of 3 or more tokens, and one pass of ``cpu.lora_segments`` over random adapters of ranks
``RANKS`` for each of the model's LoRA groups, per segment length, per way or way of the expand.
"""

from __future__ import annotations

import enum
import functools
import time
from typing import NamedTuple

import torch

from loraserve.kernels import cpu
from loraserve.models.cpu_load import best_alternating_passes

RANKS = (64, 16, 32, 8) * 2  # the timed adapters' ranks, in the order segments take them
MAX_LAYERS, LAYER_BYTES = 8, 64 * 2**20  # layers of distinct weights per group, within this many bytes
MAX_TOKENS = 768  # tokens of one timed call (segments of a class: up to 8 adapters)
LOOPS_MAX_TOKENS = 32  # segments longer than this may run as GEMMs (kTiledMax, kernels/csrc/lora_tiled.h)
EXPAND_RANK_BLOCKS = (cpu.EXPAND_RANK_BLOCK, 0)  # the vector expand's rank blocks timed (0: the whole rank)
EXPAND_LENGTHS = (8, LOOPS_MAX_TOKENS)  # segment lengths the expands are timed on: one token block (decode), four


class LoRAWay(str, enum.Enum):
    """How the compiled kernel runs the segments of one length class (3 or more tokens)."""

    AMX = "amx"  # AMX tiles (bfloat16 pool)
    VECTOR = "vector"  # the vector loops; segments of more than 32 tokens in pieces
    GEMM = "gemm"  # MKL's grouped GEMM (more than 32 tokens; the vector loops below)


# The kernel's (tile_lengths, loop_lengths) bits that put a class on each way.
WAY_MASKS = {
    LoRAWay.AMX: (cpu.EVERY_TILE_LENGTH, 0),
    LoRAWay.VECTOR: (0, cpu.EVERY_LOOP_LENGTH),
    LoRAWay.GEMM: (0, 0),
}


GroupShape = tuple[int, tuple[int, ...]]  # (in_features, out widths of the group's modules)


class Expand(NamedTuple):
    """How the vector loops' expand runs: B's rows streamed ``rank_block`` at a time (0: the whole
    rank), by float FMAs or by bfloat16 pair dots (``pairs``: v rounded to bfloat16; ``cpu.py``)."""

    rank_block: int = cpu.EXPAND_RANK_BLOCK
    pairs: bool = False

    @property
    def key(self) -> str:  # the name of its timings
        block = f"expand rank block {self.rank_block or 'whole'}"
        return f"{block}, pair dots" if self.pairs else block


DEFAULT_EXPAND = Expand()


def expand_candidates(dtype: torch.dtype) -> tuple[Expand, ...]:
    """The expands timed for a pool of ``dtype``, the default first: each rank block, by float FMAs,
    and by pair dots too over a bfloat16 pool where the build has them (``cpu.lora_pair_dots()``)."""
    pairs = (False, True) if dtype == torch.bfloat16 and cpu.lora_pair_dots() else (False,)
    return tuple(Expand(block, by_pairs) for by_pairs in pairs for block in EXPAND_RANK_BLOCKS)


def time_ways(
    shapes: tuple[GroupShape, ...],
    dtype: torch.dtype,
    page_elems: int,
    lengths: list[int],
    ways: tuple[LoRAWay, ...],
    expand: Expand = DEFAULT_EXPAND,
) -> dict[str, list[float]]:
    """Seconds of one pass over every group and timed layer, per way and length: the best of several
    passes, the ways alternating (a drift of the machine slows both alike). Only the ways that can
    run a length are timed (the GEMM: more than 32 tokens), and only lengths that more than one way
    can run; the others get 0. The vector loops' expand runs as ``expand`` says."""
    gen = torch.Generator().manual_seed(0)
    groups = [_GroupCase(in_features, outs, dtype, page_elems, gen) for in_features, outs in shapes]
    times: dict[str, list[float]] = {way.value: [] for way in ways}
    with torch.no_grad():
        for length in lengths:
            runnable = [way for way in ways if way is not LoRAWay.GEMM or length > LOOPS_MAX_TOKENS]
            best: dict[str, float] = {}
            if len(runnable) > 1:
                calls = [case.call(length, gen) for case in groups]
                best = best_alternating_passes(
                    {way.value: functools.partial(_one_pass, calls, *WAY_MASKS[way], expand) for way in runnable}
                )
            for way in ways:
                times[way.value].append(best.get(way.value, 0.0))
    return times


def time_expands(
    shapes: tuple[GroupShape, ...], dtype: torch.dtype, page_elems: int, candidates: tuple[Expand, ...]
) -> dict[str, list[float]]:
    """Seconds of one pass over every group and timed layer on the vector loops, per expand of
    ``candidates`` (by ``Expand.key``) and ``EXPAND_LENGTHS`` length, as ``time_ways`` times the ways."""
    gen = torch.Generator().manual_seed(1)
    groups = [_GroupCase(in_features, outs, dtype, page_elems, gen) for in_features, outs in shapes]
    times: dict[str, list[float]] = {expand.key: [] for expand in candidates}
    with torch.no_grad():
        for length in EXPAND_LENGTHS:
            calls = [case.call(length, gen) for case in groups]
            best = best_alternating_passes(
                {
                    expand.key: functools.partial(_one_pass, calls, *WAY_MASKS[LoRAWay.VECTOR], expand)
                    for expand in candidates
                }
            )
            for key, seconds in best.items():
                times[key].append(seconds)
    return times


class Call(NamedTuple):
    """One timed call of ``cpu.lora_segments`` for each of ``layers`` layers (group 0)."""

    layers: int
    x: torch.Tensor  # [tokens, in_features] of the pool's dtype
    outs: tuple[torch.Tensor, ...]  # each [tokens, width] of the pool's dtype
    storage: torch.Tensor  # [layers, pages, page_elems] float32 | bfloat16
    bounds: torch.Tensor  # [segments, 4] int64
    tables: torch.Tensor  # [segments, pages] int64
    meta: torch.Tensor  # [layers, 1, segments, 14] int64
    scales: torch.Tensor  # [layers, 1, segments, 3] float32


def _one_pass(calls: list[Call], tile_lengths: int, loop_lengths: int, expand: Expand) -> float:
    start = time.perf_counter()
    for c in calls:
        for layer in range(c.layers):
            cpu.lora_segments(
                c.x, c.outs, c.storage, layer, 0, c.bounds, c.tables, c.meta, c.scales, tile_lengths, loop_lengths,
                expand.rank_block, expand.pairs,
            )  # fmt: skip
    return time.perf_counter() - start


class _GroupCase:
    """Random adapters of ``RANKS`` for one group in a pool of ``dtype``, each on its own consecutive pages."""

    def __init__(
        self, in_features: int, outs: tuple[int, ...], dtype: torch.dtype, page_elems: int, gen: torch.Generator
    ) -> None:
        self.in_features, self.outs, self.dtype = in_features, outs, dtype
        flats: list[torch.Tensor] = []
        metas: list[list[int]] = []
        for rank in RANKS:
            rows = rank * len(outs)
            parts = [torch.randn(rows * in_features, generator=gen) / in_features**0.5]  # A [rows, in]
            meta, offset = [0, rows], rows * in_features
            for index, width in enumerate(outs):
                parts.append(torch.randn(rank * width, generator=gen) / rank**0.5)  # B^T [rank, width]
                meta += [index * rank, rank, offset, width]
                offset += rank * width
            flats.append(torch.cat(parts))
            metas.append(meta + [0, 0, 0, 0] * (3 - len(outs)))
        self.pages = max(-(-f.numel() // page_elems) for f in flats)  # pages per adapter
        layer_bytes = dtype.itemsize * self.pages * page_elems * len(RANKS)
        self.layers = max(1, min(MAX_LAYERS, LAYER_BYTES // layer_bytes))
        storage = torch.zeros(self.layers, len(RANKS) * self.pages, page_elems, dtype=dtype)
        for i, flat in enumerate(flats):
            padded = torch.zeros(self.pages * page_elems)
            padded[: flat.numel()] = flat
            storage[:, i * self.pages : (i + 1) * self.pages] = padded.view(self.pages, page_elems)
        self.storage = storage  # [layers, adapters * pages, page_elems]
        self.metas = metas

    def call(self, length: int, gen: torch.Generator) -> Call:
        """Segments of ``length`` tokens, one per adapter (up to ``MAX_TOKENS`` tokens, at least 2)."""
        num = max(2, min(len(RANKS), MAX_TOKENS // length))
        adapters = [i % len(RANKS) for i in range(num)]
        bounds = torch.tensor([(s * length, (s + 1) * length, 0, a * self.pages * self.storage.shape[2])
                               for s, a in enumerate(adapters)])  # fmt: skip
        tables = torch.tensor([[a * self.pages + p for p in range(self.pages)] for a in adapters])
        meta = torch.tensor([self.metas[a] for a in adapters])[None, None].expand(self.layers, 1, -1, -1)
        scales = torch.ones(self.layers, 1, num, 3)
        x = torch.randn(num * length, self.in_features, generator=gen).to(self.dtype)
        outs = tuple(torch.zeros(num * length, width, dtype=self.dtype) for width in self.outs)
        return Call(self.layers, x, outs, self.storage, bounds, tables, meta.contiguous(), scales)
