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
when more than ``TIE_TOLERANCE`` faster. How the vector loops' expand runs is timed first, on
segments of ``EXPAND_LENGTHS`` tokens, and the ways' loops then run with it: how many of B's rows it
streams at once (``EXPAND_RANK_BLOCKS``: a few, or the whole rank; the results are the same), and,
over a bfloat16 pool where the build has them, whether by bfloat16 pair dots (v rounded to
bfloat16, ``kernels/cpu.py``) or float FMAs; another than the default (a few rows, float) is kept
only when more than a tie faster. (The timed passes: ``lora/lora_timing.py``.) The choice is
cached per CPU signature in
``<cache>/cpu_lora/`` (``choice_file``) and shown in ``/health``. A timing that other processes
disturbed is repeated once, and if disturbed again serves this process without being cached.
``--cpu-lora amx|vector`` forces every class on the tiles, or on the vector loops (with the default
expand: a forced plan times nothing).
"""

from __future__ import annotations

import functools
import logging
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
from loraserve.lora.lora_timing import (
    LOOPS_MAX_TOKENS,
    Expand,
    GroupShape,
    LoRAWay,
    expand_candidates,
    time_expands,
    time_ways,
)
from loraserve.timed_choice import TilePolicy, timed_choice

logger = logging.getLogger(__name__)

CACHE_FORMAT = 4  # 4: a way per class, the expand's rank block and pairs (3: no pairs; 2: the ways; 1: tiles)
TIE_TOLERANCE = 0.03  # a way other than the default must be this much faster to be kept (noise between passes)


class LoRAChoice(NamedTuple):
    """A timed (or cached) choice: the way per segment-length class, the vector loops' expand."""

    ways: tuple[LoRAWay, ...]
    expand: Expand


_DISTURBED: dict[str, LoRAChoice] = {}  # choices timed under load in this process, by cache key


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
    expand_pairs: bool = False  # the vector expand by bfloat16 pair dots (v rounded to bfloat16)
    seconds: float = 0.0  # spent timing
    # Per way, per class: the timings (0: not timed); per expand (Expand.key), per EXPAND_LENGTHS length.
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
            "expand": "pair dots" if self.expand_pairs else "float",
        }

    def summary(self) -> str:
        by_length: dict[str, str] = self.as_dict()["segment_tokens"]
        block = f"; expand: {self.as_dict()['expand']}, rank block {self.as_dict()['expand_rank_block']}"
        if len(set(by_length.values())) == 1:
            return f"{self.source}; every length: {next(iter(by_length.values()))}{block}"
        return f"{self.source}; " + ", ".join(f"{name}: {way}" for name, way in by_length.items()) + block


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
            raise ConfigError(
                f"cpu_lora={policy.kernel!r} needs the compiled CPU LoRA kernel: kernels 'cpu' with a float32 or "
                f"bfloat16 model, not kernels {backend.name!r} with {str(dtype).removeprefix('torch.')}"
            )
        return backend.make_lora_hook, None
    plan = choose_lora_kernels(group_shapes(module_shapes), dtype, page_elems, policy)
    logger.info("CPU LoRA kernel by segment length (%.1f s timing): %s", plan.seconds, plan.summary())
    hook = functools.partial(
        backend.make_lora_hook,
        tile_lengths=plan.tile_lengths,
        loop_lengths=plan.loop_lengths,
        expand_rank_block=plan.expand_rank_block,
        expand_pairs=plan.expand_pairs,
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
    expands = expand_candidates(dtype)

    def decide(times: dict[str, list[float]]) -> LoRAChoice:  # another way where more than a tie faster
        chosen = []
        for c, length in enumerate(lengths):
            default = LoRAWay.GEMM if length > LOOPS_MAX_TOKENS else LoRAWay.VECTOR
            timed = [way for way in ways if times[way.value][c] > 0]
            best = min(timed, key=lambda way: times[way.value][c], default=default)
            faster = times[best.value][c] < times[default.value][c] * (1 - TIE_TOLERANCE)
            chosen.append(best if faster else default)
        return LoRAChoice(tuple(chosen), pick_expand(times, expands))

    def read(entry: Any) -> LoRAChoice | None:
        known = {way.value for way in ways}
        if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[1], list) or len(entry[1]) != 2:
            return None
        names, (block, pairs) = entry
        if type(block) is not int or type(pairs) is not bool or Expand(block, pairs) not in expands:
            return None  # (a JSON false for a block == 0, so the types are checked)
        if not isinstance(names, list) or len(names) != num_classes or not all(e in known for e in names):
            return None
        return LoRAChoice(tuple(LoRAWay(e) for e in names), Expand(block, pairs))

    def time_all() -> dict[str, list[float]]:  # the expand first: the ways' loops then run with it
        timed = time_expands(shapes, dtype, page_elems, expands)
        return time_ways(shapes, dtype, page_elems, lengths, ways, pick_expand(timed, expands)) | timed

    choice = timed_choice(
        ChoiceFile(policy.cache_dir, "LoRA kernel"), build_key(what, CACHE_FORMAT), _DISTURBED, time_all, decide, read
    )
    ways_chosen, expand = choice.value
    return LoRAKernelPlan(
        ways_chosen, bounds, choice.source, expand.rank_block, expand.pairs, choice.seconds, choice.ms
    )


def pick_expand(times: dict[str, list[float]], candidates: tuple[Expand, ...]) -> Expand:
    """The vector loops' expand: the default (the first candidate) unless another is more than a tie
    faster in all (summed over the timed lengths)."""
    totals = {expand: sum(times[expand.key]) for expand in candidates}
    default = candidates[0]
    best = min(totals, key=totals.__getitem__)
    return best if totals[best] < totals[default] * (1 - TIE_TOLERANCE) else default


def _middle(length_class: int, bounds: tuple[int, ...]) -> int:
    """A segment length in the middle of a class (the last class, open above: taken to end at twice
    the bound before it, so 513+ is timed at 769 tokens)."""
    low = 3 if length_class == 0 else bounds[length_class - 1] + 1
    high = bounds[length_class] if length_class < len(bounds) else 2 * (low - 1)
    return (low + high + 1) // 2
