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
from pathlib import Path
from typing import Any

import torch

from loraserve.choice_file import ChoiceFile, build_key
from loraserve.config import CPU_TILE_CHOICES, ConfigError
from loraserve.kernels import cpu, cpu_features
from loraserve.models.cpu_load import OtherLoad, best_alternating_passes
from loraserve.models.llama import ModelKernels
from loraserve.models.rope import head_dim

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
TIE_TOLERANCE = 0.03  # the tiles must be this much faster to be kept (noise between passes)
TIMING_ATTEMPTS = 2  # a timing disturbed by other processes is repeated once
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
class PrefillAttentionPolicy:
    """``kernel``: ``auto`` (timed, cached under ``cache_dir``; None: timed at every start),
    ``amx`` (the tiles; needs them) or ``vector`` (never the tiles)."""

    kernel: str = "auto"
    cache_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.kernel not in CPU_TILE_CHOICES:
            raise ValueError(f"cpu_prefill_attention must be one of {CPU_TILE_CHOICES}, got {self.kernel!r}")


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
            shown["ms"] = {way: dict(zip(CASES, ms, strict=True)) for way, ms in self.ms.items()}
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
    if policy.kernel == "amx" and not has_tiles:
        raise ValueError(
            "cpu_prefill_attention='amx' needs bfloat16 on a CPU with AMX tiles (amx_bf16, avx512_bf16) that the OS "
            f"grants; this is {dtype} on {cpu_features.summary()}"
        )
    if not has_tiles or policy.kernel != "auto":
        return PrefillAttentionPlan(policy.kernel == "amx", "forced" if policy.kernel != "auto" else "no tiles")
    rows = max(1, min(max_rows, MAX_ROWS))
    what = (
        f"bfloat16 heads={shape.num_heads}/{shape.num_kv_heads}x{shape.head_dim} block={shape.block_size} rows={rows}"
    )
    key = build_key(what, CACHE_FORMAT)
    cache = ChoiceFile(policy.cache_dir, "prefill attention")
    cached = cache.get(key)
    if isinstance(cached, dict) and isinstance(cached.get("tiles"), bool):
        return PrefillAttentionPlan(cached["tiles"], "cached", ms=cached.get("ms", {}))
    if policy.cache_dir is not None and key in _DISTURBED:
        return PrefillAttentionPlan(_DISTURBED[key], "disturbed")
    start = time.perf_counter()
    for _ in range(TIMING_ATTEMPTS):
        with OtherLoad() as load:
            times = time_both_ways(shape, rows)
        if not load.disturbed:
            break
    tiles = sum(times["amx"]) < sum(times["vector"]) * (1 - TIE_TOLERANCE)
    ms = {way: [round(t * 1e3, 3) for t in ts] for way, ts in times.items()}
    seconds = time.perf_counter() - start
    if load.disturbed:
        logger.warning(
            "the prefill attention timing was disturbed (other processes kept %.1f CPUs busy): its choice serves "
            "this process and is timed again at the next start",
            load.cores,
        )
        _DISTURBED[key] = tiles
        return PrefillAttentionPlan(tiles, "disturbed", seconds, ms)
    cache.put(key, {"tiles": tiles, "ms": ms, "cpu": cpu_features.summary()})
    return PrefillAttentionPlan(tiles, "measured", seconds, ms)


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
