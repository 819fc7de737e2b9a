"""Choosing whether bfloat16 prefill attention runs on AMX tiles, by timing it on this CPU.

On a CPU with AMX (``cpu.prefill_attention_amx()``) the compiled prefill attention can run its
query-key and probability-value products on the tiles or on the vector loops (``tiles=False``).
Both ways are timed on the model's head shape and block size over two steps: a full step of
prompts of 64-128 tokens from scratch (the step's token budget, at most ``MAX_ROWS``) and one
chunk of up to 512 tokens over 1,536 cached ones; the ways alternating, the best of several
passes. The tiles are kept when their total is more than ``TIE_TOLERANCE`` faster. The choice is
cached per CPU signature in ``<cache>/cpu_attention/`` (``choice_file``) and shown in ``/health``.
A timing that other processes disturbed is repeated once, and if disturbed again serves this
process without being cached. ``--cpu-prefill-attention amx|vector`` forces one way.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

from loraserve.choice_file import ChoiceFile, build_key
from loraserve.config import ConfigError
from loraserve.kernels import cpu, cpu_features
from loraserve.models.cpu_load import best_alternating_passes
from loraserve.models.model_kernels import ModelKernels
from loraserve.models.rope import head_dim
from loraserve.timed_choice import TilePolicy, timed_choice

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
TIE_TOLERANCE = 0.03  # the tiles must be this much faster to be kept (noise between passes)
MAX_ROWS = 2048  # query rows of the timed full step
CACHED_TOKENS, CHUNK_ROWS = 1536, 512  # the timed chunk over a cached prefix
CASES = ("prompts", "chunk over cache")  # the timed steps, in the order of PrefillAttentionPlan.ms

_DISTURBED: dict[str, bool] = {}  # choices timed under load in this process, by cache key


@dataclass(frozen=True)
class AttentionShape:
    """What the prefill attention's speed depends on, besides the CPU and the dtype."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @classmethod
    def of_model(cls, hf_config: Any, block_size: int) -> AttentionShape:
        heads = int(hf_config.num_attention_heads)
        kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        return cls(heads, kv_heads, head_dim(hf_config), block_size)


@dataclass(frozen=True)
class PrefillAttentionPolicy(TilePolicy):
    """``TilePolicy`` of ``--cpu-prefill-attention``."""

    OPTION: ClassVar[str] = "cpu_prefill_attention"


@dataclass(frozen=True)
class PrefillAttentionPlan:
    """Whether the prefill attention runs on the tiles, and how that was decided."""

    tiles: bool
    source: str  # measured | cached | forced | disturbed | no tiles (not bfloat16, or a CPU without AMX)
    seconds: float = 0.0  # spent timing
    ms: dict[str, list[float]] = field(default_factory=dict)  # per way, per case of CASES: the timings

    def as_dict(self) -> dict[str, Any]:
        shown: dict[str, Any] = {
            "source": self.source,
            "cpu": cpu_features.summary(),
            "timing_seconds": round(self.seconds, 2),
        }
        shown["kernel"] = "amx" if self.tiles else "vector"
        if self.ms:
            # labelled by case where a (cached) entry has one timing per case, else as it is
            shown["ms"] = {
                way: dict(zip(CASES, ms, strict=True)) if len(ms) == len(CASES) else ms for way, ms in self.ms.items()
            }
        return shown


def prefill_attention_kernels(
    backend_name: str, kernels: ModelKernels, shape: AttentionShape, dtype: torch.dtype, max_rows: int,
    policy: PrefillAttentionPolicy,
) -> tuple[ModelKernels, PrefillAttentionPlan | None]:  # fmt: skip
    """The model's kernels with the prefill attention of the plan (the compiled CPU backend's), and
    that plan; other backends' kernels unchanged and None (they refuse a forced way)."""
    if backend_name != "cpu":
        if policy.kernel != "auto":
            raise ConfigError(f"cpu_prefill_attention={policy.kernel!r} needs the compiled CPU kernels (kernels 'cpu')")
        return kernels, None
    plan = choose_prefill_attention(shape, dtype, max_rows, policy)
    logger.info("CPU prefill attention (%.1f s timing): %s, %s", plan.seconds, plan.as_dict()["kernel"], plan.source)
    attention = functools.partial(cpu.paged_prefill_attention, tiles=plan.tiles)
    return replace(kernels, prefill_attention=attention), plan


def choose_prefill_attention(
    shape: AttentionShape, dtype: torch.dtype, max_rows: int, policy: PrefillAttentionPolicy
) -> PrefillAttentionPlan:
    """The plan for ``dtype`` and a model of ``shape``, steps of up to ``max_rows`` query rows:
    forced, cached or timed."""
    has_tiles = dtype == torch.bfloat16 and cpu.prefill_attention_amx()
    untimed = policy.untimed(has_tiles, dtype, "bfloat16")
    if untimed is not None:
        return PrefillAttentionPlan(*untimed)
    rows = max(1, min(max_rows, MAX_ROWS))
    what = f"bfloat16 heads={shape.num_heads}/{shape.num_kv_heads}x{shape.head_dim} block={shape.block_size}"

    def decide(times: dict[str, list[float]]) -> bool:  # the tiles when more than a tie faster in all
        return sum(times["amx"]) < sum(times["vector"]) * (1 - TIE_TOLERANCE)

    choice = timed_choice(
        ChoiceFile(policy.cache_dir, "prefill attention"),
        build_key(f"{what} rows={rows}", CACHE_FORMAT),
        _DISTURBED,
        lambda: time_both_ways(shape, rows),
        decide,
        lambda tiles: tiles if isinstance(tiles, bool) else None,
    )
    return PrefillAttentionPlan(choice.value, choice.source, choice.seconds, choice.ms)


def time_both_ways(shape: AttentionShape, rows: int) -> dict[str, list[float]]:
    """Seconds of one call per way ("amx", "vector") and case of ``CASES``: the best of several
    passes, the ways alternating (a drift of the machine slows both alike)."""
    gen = torch.Generator().manual_seed(0)
    prompts: list[int] = []
    while sum(prompts) < rows:
        prompts.append(min(64 + len(prompts) * 29 % 65, rows - sum(prompts)))  # 64-128 tokens, the last cut
    cases = [([0] * len(prompts), prompts), ([CACHED_TOKENS], [min(CHUNK_ROWS, rows)])]
    times: dict[str, list[float]] = {"amx": [], "vector": []}
    with torch.no_grad():
        for cached, new in cases:
            call = _case(shape, cached, new, gen)
            best = best_alternating_passes({way: functools.partial(_one_call, call, way == "amx") for way in times})
            for way in times:
                times[way].append(best[way])
    return times


_Call = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]


def _case(shape: AttentionShape, cached: list[int], new: list[int], gen: torch.Generator) -> _Call:
    """``(query, kv, query_starts, cached_lens, block_tables, scale)`` of random bfloat16 chunks,
    each on its own consecutive pages."""
    block = shape.block_size
    blocks = [-(-(c + n) // block) for c, n in zip(cached, new, strict=True)]
    kv = torch.randn(sum(blocks), 2, block, shape.num_kv_heads, shape.head_dim, generator=gen).to(torch.bfloat16)
    firsts = [sum(blocks[:i]) for i in range(len(blocks))]
    width = max(blocks)
    rows = [[first + b if b < count else 0 for b in range(width)] for first, count in zip(firsts, blocks, strict=True)]
    tables = torch.tensor(rows)  # [chunks, width], padded with page 0
    starts = torch.tensor([0, *(sum(new[: i + 1]) for i in range(len(new)))])
    query = torch.randn(sum(new), shape.num_heads, shape.head_dim, generator=gen).to(torch.bfloat16)
    return query, kv, starts, torch.tensor(cached), tables, shape.head_dim**-0.5


def _one_call(call: _Call, tiles: bool) -> float:
    start = time.perf_counter()
    cpu.paged_prefill_attention(*call, tiles=tiles)
    return time.perf_counter() - start
