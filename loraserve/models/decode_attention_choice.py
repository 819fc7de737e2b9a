"""Choosing the compiled decode attention's variant, by timing them on this CPU.

The compiled paged decode attention has up to three register-tiled variants
(``cpu.decode_attention_variants()``): ``pairs`` (bfloat16 scores by AVX512-BF16 pair dots, where
the build targets it), ``avx512`` (16 lanes, where the build targets AVX-512) and ``vec8`` (8
lanes, every build). Which is fastest depends on the CPU and the dtype (a float32 step mostly waits
on reading the KV from memory; a bfloat16 one spends more of its time widening it), so those that
tile the dtype and shape are timed on the model's head shape and block size: a decode step of the
engine's batch (at most ``MAX_SEQS`` sequences of 96-160 cached tokens) over several layers' KV
(``TIMED_BYTES`` in all, so that most of it is read from memory as in a step), the variants
alternating, the best of several passes. The fastest is kept where it is more than
``TIE_TOLERANCE`` faster than ``vec8``, else ``vec8``. The choice is cached per CPU signature in
``<cache>/cpu_attention/`` (``choice_file``) and shown in ``/health``;
``--cpu-decode-attention pairs|avx512|vec8`` forces one. A build with one variant needs no timing,
nor do a dtype and shape that at most one variant tiles (``cpu.decode_attention_tilings``: float16
and head sizes no tiling takes run on the generic loops whichever variant is named).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loraserve.choice_file import ChoiceFile, build_key
from loraserve.config import CPU_DECODE_ATTENTION_CHOICES, ConfigError
from loraserve.kernels import cpu, cpu_features
from loraserve.models.attention_choice import AttentionShape
from loraserve.models.cpu_load import best_alternating_passes
from loraserve.timed_choice import timed_choice

CACHE_FORMAT = 2  # 2: the pairs variant is a candidate
TIE_TOLERANCE = 0.03  # another variant must be this much faster than vec8 to be kept (noise between passes)
MAX_SEQS = 64  # sequences of the timed step
TIMED_BYTES = 96 << 20  # KV read by one timed pass, over as many layers as that takes
CONTEXTS = (96, 160)  # cached tokens of the timed sequences, spread evenly over this range

_DISTURBED: dict[str, str] = {}  # choices timed under load in this process, by cache key


@dataclass(frozen=True)
class DecodeAttentionPolicy:
    """``variant``: ``auto`` (timed, cached under ``cache_dir``; None: timed at every start), or
    one of ``cpu.decode_attention_variants()`` (forced; refused where this build lacks it)."""

    variant: str = "auto"
    cache_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.variant not in CPU_DECODE_ATTENTION_CHOICES:
            choices = CPU_DECODE_ATTENTION_CHOICES
            raise ValueError(f"cpu_decode_attention must be one of {choices}, got {self.variant!r}")


@dataclass(frozen=True)
class DecodeAttentionPlan:
    """The variant the decode attention is called with, the kernel that then runs, and how it was decided."""

    variant: str
    source: str  # measured | cached | forced | disturbed | only one (one variant built, or tiling the shape)
    kernel: str  # what runs: the variant, the next narrower one that tiles the shape, or "generic"
    seconds: float = 0.0  # spent timing
    ms: dict[str, list[float]] = field(default_factory=dict)  # per variant: the timed step

    def as_dict(self) -> dict[str, Any]:
        shown: dict[str, Any] = {"kernel": self.kernel, "variant": self.variant, "source": self.source}
        shown["cpu"] = cpu_features.summary()
        shown["timing_seconds"] = round(self.seconds, 2)
        if self.ms:
            shown["ms"] = self.ms
        return shown


def choose_decode_attention(
    shape: AttentionShape, dtype: torch.dtype, max_seqs: int, policy: DecodeAttentionPolicy
) -> DecodeAttentionPlan:
    """The plan for ``dtype`` KV and a model of ``shape``, batches of up to ``max_seqs``: forced,
    the one variant of this build, cached or timed."""
    variants = cpu.decode_attention_variants()
    tilings = [v for v in cpu.decode_attention_tilings(dtype, shape.head_dim, shape.block_size) if v in variants]

    def running(variant: str) -> str:
        """The variant, or the next narrower one that tiles the shape, or the generic loops."""
        later = variants[variants.index(variant) :] if variant in variants else []
        return next((v for v in later if v in tilings), "generic")

    if policy.variant != "auto":
        if policy.variant not in variants:
            raise ConfigError(
                f"cpu_decode_attention={policy.variant!r} is not compiled for this CPU ({cpu_features.summary()}); "
                f"this build has {variants}"
            )
        return DecodeAttentionPlan(policy.variant, "forced", running(policy.variant))
    if len(variants) < 2 or len(tilings) < 2:  # one variant runs whichever is named: nothing to time
        variant = tilings[0] if tilings else variants[-1] if variants else "vec8"
        return DecodeAttentionPlan(variant, "only one", running(variant))
    timed = tuple(tilings)  # widest first, the narrowest (the default) last
    seqs = max(1, min(max_seqs, MAX_SEQS))
    what = f"{dtype} heads={shape.num_heads}/{shape.num_kv_heads}x{shape.head_dim} block={shape.block_size}"

    def decide(times: dict[str, list[float]]) -> str:
        total = {variant: sum(times[variant]) for variant in timed}
        fastest = min(timed, key=total.__getitem__)
        return fastest if total[fastest] < total[timed[-1]] * (1 - TIE_TOLERANCE) else timed[-1]

    choice = timed_choice(
        ChoiceFile(policy.cache_dir, "decode attention"),
        build_key(f"{what} seqs={seqs}", CACHE_FORMAT),
        _DISTURBED,
        lambda: time_variants(shape, dtype, seqs, timed),
        decide,
        lambda cached: cached if cached in variants else None,
    )
    return DecodeAttentionPlan(choice.value, choice.source, choice.value, choice.seconds, choice.ms)


def time_variants(
    shape: AttentionShape, dtype: torch.dtype, seqs: int, variants: tuple[str, ...]
) -> dict[str, list[float]]:
    """Seconds of one timed step (every layer's call) per variant: the best of several passes,
    the variants alternating."""
    block = shape.block_size
    contexts = [CONTEXTS[0] + (CONTEXTS[1] - CONTEXTS[0]) * i // seqs for i in range(seqs)]
    blocks = [-(-n // block) for n in contexts]
    page_bytes = 2 * block * shape.num_kv_heads * shape.head_dim * torch.tensor([], dtype=dtype).element_size()
    layers = max(1, TIMED_BYTES // (page_bytes * sum(blocks)))
    # Zeros: the speed does not depend on the values, and writing them maps every page.
    kvs = [torch.zeros(sum(blocks), 2, block, shape.num_kv_heads, shape.head_dim, dtype=dtype) for _ in range(layers)]
    # Each sequence's pages scattered over the pool, as in a pool that served many requests.
    pages = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(0)).tolist()
    width, firsts = max(blocks), [sum(blocks[:i]) for i in range(seqs)]
    rows = [[pages[first + b] if b < n else 0 for b in range(width)] for first, n in zip(firsts, blocks, strict=True)]
    tables = torch.tensor(rows, dtype=torch.int64)  # [seqs, width]
    lens = torch.tensor(contexts, dtype=torch.int64)
    query = torch.zeros(seqs, shape.num_heads, shape.head_dim, dtype=dtype)
    call = (query, tables, lens, shape.head_dim**-0.5)
    with torch.no_grad():
        best = best_alternating_passes({v: functools.partial(_one_pass, call, kvs, v) for v in variants})
    return {v: [best[v]] for v in variants}


_Call = tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]  # query, block tables, context lengths, scale


def _one_pass(call: _Call, kvs: list[torch.Tensor], variant: str) -> float:
    query, tables, lens, scale = call
    start = time.perf_counter()
    for kv in kvs:
        cpu.paged_decode_attention(query, kv, tables, lens, scale, variant=variant)
    return time.perf_counter() - start
