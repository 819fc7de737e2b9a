"""Choosing, per segment length, the way the compiled CPU kernel runs LoRA, by timing the ways.

A segment of 3 or more tokens runs on the vector loops (register tiles, the weights read in place;
segments of more than 32 tokens in pieces of at most 32), on MKL's grouped GEMM (more than 32
tokens only; the weights copied out, and widened from bfloat16, where MKL cannot read them in
place), or, over a bfloat16 pool on a CPU with AMX (``cpu.lora_amx()``), on the tiles. Which is
fastest depends on the CPU, the dtype, the model's widths and the segment's length. For each
segment-length class of the kernel (``cpu.lora_tile_length_bounds()``: up to 8 tokens, 16, 32, 64,
128, 256, 512, longer) that more than one way can run, those ways are timed on the model's four
LoRA groups (q/k/v, o, gate/up, down) with adapters of ranks 64/32/16/8, segments of the middle of
the class, over up to 8 layers of distinct weights, alternating, the best of several passes; a way
other than the class's default (the vector loops up to 32 tokens, the GEMM beyond) is kept only
when more than ``TIE_TOLERANCE`` faster. How many of B's rows the vector loops' expand streams at
once (``EXPAND_RANK_BLOCKS``: a few, or the whole rank; the results are the same) is timed with them,
on segments of ``RANK_BLOCK_LENGTHS`` tokens; the whole rank is kept only when more than a tie
faster. The choice is cached per CPU signature in
``<cache>/cpu_lora/`` (``choice_file``) and shown in ``/health``. A timing that other processes
disturbed is repeated once, and if disturbed again serves this process without being cached.
``--cpu-lora amx|vector`` forces every class on the tiles, or on the vector loops (with the default
rank block: a forced plan times nothing).
"""

from __future__ import annotations

import enum
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

from loraserve.choice_file import ChoiceFile, build_key
from loraserve.config import ConfigError
from loraserve.kernel_backend import KernelBackend
from loraserve.kernels import cpu, cpu_features
from loraserve.lora.apply_torch import PerBatchLoRAHook
from loraserve.lora.layout import LORA_GROUPS
from loraserve.models.cpu_load import best_alternating_passes
from loraserve.timed_choice import TilePolicy, timed_choice

logger = logging.getLogger(__name__)

CACHE_FORMAT = 3  # 3: a way per class and the expand's rank block (2: the ways; 1: whether on the tiles)
RANKS = (64, 16, 32, 8) * 2  # the timed adapters' ranks, in the order segments take them
TIE_TOLERANCE = 0.03  # a way other than the default must be this much faster to be kept (noise between passes)
MAX_LAYERS, LAYER_BYTES = 8, 64 * 2**20  # layers of distinct weights per group, within this many bytes
MAX_TOKENS = 768  # tokens of one timed call (segments of a class: up to 8 adapters)
LOOPS_MAX_TOKENS = 32  # segments longer than this may run as GEMMs (kTiledMax, kernels/csrc/lora_tiled.h)
EXPAND_RANK_BLOCKS = (cpu.EXPAND_RANK_BLOCK, 0)  # the vector expand's rank blocks timed (0: the whole rank)
RANK_BLOCK_LENGTHS = (8, LOOPS_MAX_TOKENS)  # segment lengths they are timed on: one token block (decode), four

_DISTURBED: dict[str, LoRAChoice] = {}  # choices timed under load in this process, by cache key


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


class LoRAChoice(NamedTuple):
    """A timed (or cached) choice: the way per segment-length class, the expand's rank block."""

    ways: tuple[LoRAWay, ...]
    expand_rank_block: int


def _rank_block_key(block: int) -> str:  # the name of a rank block's timings
    return f"expand rank block {block or 'whole'}"


@dataclass(frozen=True)
class LoRAKernelPolicy(TilePolicy):
    """``TilePolicy`` of ``--cpu-lora``: ``amx`` puts every segment length on the tiles, ``vector``
    on the vector loops."""

    OPTION: ClassVar[str] = "cpu_lora"


@dataclass(frozen=True)
class LoRAKernelPlan:
    """Per segment-length class (``bounds``, the last class longer), the way it runs."""

    ways: tuple[LoRAWay, ...]
    bounds: tuple[int, ...]
    source: str  # measured | cached | forced | disturbed
    expand_rank_block: int = cpu.EXPAND_RANK_BLOCK  # B's rows the vector expand streams at once (0: all)
    seconds: float = 0.0  # spent timing
    # Per way, per class: the timings (0: not timed); per rank block, per RANK_BLOCK_LENGTHS length.
    ms: dict[str, list[float]] = field(default_factory=dict)

    @property
    def tile_lengths(self) -> int:
        """The kernel's ``tile_lengths`` bit mask: the classes on AMX tiles."""
        return sum(1 << c for c, way in enumerate(self.ways) if way is LoRAWay.AMX)

    @property
    def loop_lengths(self) -> int:
        """The kernel's ``loop_lengths`` bit mask: the classes on the vector loops."""
        return sum(1 << c for c, way in enumerate(self.ways) if way is LoRAWay.VECTOR)

    def class_names(self) -> list[str]:
        lows = [3, *(b + 1 for b in self.bounds)]
        highs = [str(b) for b in self.bounds] + [""]
        return [f"{low}-{high}" if high else f"{low}+" for low, high in zip(lows, highs, strict=True)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "cpu": cpu_features.summary(),
            "timing_seconds": round(self.seconds, 2),
            "segment_tokens": {name: way.value for name, way in zip(self.class_names(), self.ways, strict=True)},
            "expand_rank_block": self.expand_rank_block or "whole rank",
        }

    def summary(self) -> str:
        by_length: dict[str, str] = self.as_dict()["segment_tokens"]
        block = f"; expand rank block: {self.as_dict()['expand_rank_block']}"
        if len(set(by_length.values())) == 1:
            return f"{self.source}; every length: {next(iter(by_length.values()))}{block}"
        return f"{self.source}; " + ", ".join(f"{name}: {way}" for name, way in by_length.items()) + block


GroupShape = tuple[int, tuple[int, ...]]  # (in_features, out widths of the group's modules)


def group_shapes(module_shapes: dict[str, tuple[int, int]]) -> tuple[GroupShape, ...]:
    """The LoRA groups' shapes from the base model's ``(in_features, out_features)`` per projection."""
    return tuple(
        (module_shapes[modules[0]][0], tuple(module_shapes[m][1] for m in modules)) for modules in LORA_GROUPS.values()
    )


def lora_hook_factory(
    backend: KernelBackend,
    module_shapes: dict[str, tuple[int, int]],
    dtype: torch.dtype,
    page_elems: int,
    policy: LoRAKernelPolicy,
) -> tuple[Callable[[torch.Tensor], PerBatchLoRAHook[Any]], LoRAKernelPlan | None]:
    """The backend's LoRA hook factory (storage -> hook), given the plan where its hook takes one (the
    compiled CPU kernel), and that plan (None for the other backends, which refuse a forced way)."""
    if not backend.lora_tile_choice:
        if policy.kernel != "auto":
            raise ConfigError(f"cpu_lora={policy.kernel!r} needs the compiled CPU LoRA kernel (kernels 'cpu')")
        return backend.make_lora_hook, None
    plan = choose_lora_kernels(group_shapes(module_shapes), dtype, page_elems, policy)
    logger.info("CPU LoRA kernel by segment length (%.1f s timing): %s", plan.seconds, plan.summary())
    hook = functools.partial(
        backend.make_lora_hook,
        tile_lengths=plan.tile_lengths,
        loop_lengths=plan.loop_lengths,
        expand_rank_block=plan.expand_rank_block,
    )
    return hook, plan


def choose_lora_kernels(
    shapes: tuple[GroupShape, ...], dtype: torch.dtype, page_elems: int, policy: LoRAKernelPolicy
) -> LoRAKernelPlan:
    """The plan for a pool of ``dtype`` and a model of LoRA group ``shapes``: forced, cached or timed."""
    bounds = cpu.lora_tile_length_bounds()
    num_classes = len(bounds) + 1
    has_tiles = dtype == torch.bfloat16 and cpu.lora_amx()
    untimed = policy.untimed(has_tiles, dtype, "a bfloat16 pool")
    if untimed is not None and untimed[1] == "forced":
        return LoRAKernelPlan(((LoRAWay.AMX if untimed[0] else LoRAWay.VECTOR),) * num_classes, bounds, "forced")
    ways = (LoRAWay.AMX, LoRAWay.VECTOR, LoRAWay.GEMM) if has_tiles else (LoRAWay.VECTOR, LoRAWay.GEMM)
    what = f"{str(dtype).removeprefix('torch.')} " + " ".join(f"{i}->{'+'.join(map(str, o))}" for i, o in shapes)
    lengths = [_middle(c, bounds) for c in range(num_classes)]

    def decide(times: dict[str, list[float]]) -> LoRAChoice:  # another way where more than a tie faster
        chosen = []
        for c, length in enumerate(lengths):
            default = LoRAWay.GEMM if length > LOOPS_MAX_TOKENS else LoRAWay.VECTOR
            timed = [way for way in ways if times[way.value][c] > 0]
            best = min(timed, key=lambda way: times[way.value][c], default=default)
            faster = times[best.value][c] < times[default.value][c] * (1 - TIE_TOLERANCE)
            chosen.append(best if faster else default)
        return LoRAChoice(tuple(chosen), pick_rank_block(times))

    def read(entry: Any) -> LoRAChoice | None:
        known = {way.value for way in ways}
        if not isinstance(entry, list) or len(entry) != 2 or entry[1] not in EXPAND_RANK_BLOCKS:
            return None
        names, block = entry
        if not isinstance(names, list) or len(names) != num_classes or not all(e in known for e in names):
            return None
        return LoRAChoice(tuple(LoRAWay(e) for e in names), block)

    choice = timed_choice(
        ChoiceFile(policy.cache_dir, "LoRA kernel"),
        build_key(what, CACHE_FORMAT),
        _DISTURBED,
        lambda: time_ways(shapes, dtype, page_elems, lengths, ways) | time_rank_blocks(shapes, dtype, page_elems),
        decide,
        read,
    )
    ways_chosen, block = choice.value
    return LoRAKernelPlan(ways_chosen, bounds, choice.source, block, choice.seconds, choice.ms)


def pick_rank_block(times: dict[str, list[float]]) -> int:
    """The expand's rank block: the default unless another is more than a tie faster in all (summed
    over the timed lengths)."""
    default = sum(times[_rank_block_key(EXPAND_RANK_BLOCKS[0])])
    totals = {block: sum(times[_rank_block_key(block)]) for block in EXPAND_RANK_BLOCKS}
    best = min(totals, key=totals.__getitem__)
    return best if totals[best] < default * (1 - TIE_TOLERANCE) else EXPAND_RANK_BLOCKS[0]


def _middle(length_class: int, bounds: tuple[int, ...]) -> int:
    """A segment length in the middle of a class (the last class, open above: taken to end at twice
    the bound before it, so 513+ is timed at 769 tokens)."""
    low = 3 if length_class == 0 else bounds[length_class - 1] + 1
    high = bounds[length_class] if length_class < len(bounds) else 2 * (low - 1)
    return (low + high + 1) // 2


def time_ways(
    shapes: tuple[GroupShape, ...], dtype: torch.dtype, page_elems: int, lengths: list[int], ways: tuple[LoRAWay, ...]
) -> dict[str, list[float]]:
    """Seconds of one pass over every group and timed layer, per way and length: the best of several
    passes, the ways alternating (a drift of the machine slows both alike). Only the ways that can
    run a length are timed (the GEMM: more than 32 tokens), and only lengths that more than one way
    can run; the others get 0."""
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
                    {way.value: functools.partial(_one_pass, calls, *WAY_MASKS[way]) for way in runnable}
                )
            for way in ways:
                times[way.value].append(best.get(way.value, 0.0))
    return times


def time_rank_blocks(shapes: tuple[GroupShape, ...], dtype: torch.dtype, page_elems: int) -> dict[str, list[float]]:
    """Seconds of one pass over every group and timed layer on the vector loops, per expand rank
    block (``_rank_block_key``) and ``RANK_BLOCK_LENGTHS`` length, as ``time_ways`` times the ways."""
    gen = torch.Generator().manual_seed(1)
    groups = [_GroupCase(in_features, outs, dtype, page_elems, gen) for in_features, outs in shapes]
    times: dict[str, list[float]] = {_rank_block_key(block): [] for block in EXPAND_RANK_BLOCKS}
    with torch.no_grad():
        for length in RANK_BLOCK_LENGTHS:
            calls = [case.call(length, gen) for case in groups]
            best = best_alternating_passes(
                {
                    _rank_block_key(block): functools.partial(_one_pass, calls, *WAY_MASKS[LoRAWay.VECTOR], block)
                    for block in EXPAND_RANK_BLOCKS
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


def _one_pass(
    calls: list[Call], tile_lengths: int, loop_lengths: int, expand_rank_block: int = cpu.EXPAND_RANK_BLOCK
) -> float:
    start = time.perf_counter()
    for c in calls:
        for layer in range(c.layers):
            cpu.lora_segments(
                c.x, c.outs, c.storage, layer, 0, c.bounds, c.tables, c.meta, c.scales, tile_lengths, loop_lengths,
                expand_rank_block,
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
