"""Choosing each linear layer's CPU GEMM kernel by timing it on this machine, and packing the model.

For every distinct layer shape (``GemmShape``: input width, output widths of a group, dtype,
bias) and every row bucket a step can produce (``ROW_BUCKETS`` up to ``GemmPolicy.max_rows``),
the candidate kernels (``kernels_for(dtype)``) are timed on the model's own weights: up to 8
layers of that shape one after another, so that the weights come from memory as in a real step
(where the caches are smaller than that), the best of several passes. A shape keeps at most one
packed copy of its weights, and only where it is clearly faster in some row bucket: it takes one
packed kernel (the one with the smallest summed slowdown against the per-bucket best) and, in the
buckets where a kernel on the plain weights is as fast, that one (``torch``: ``F.linear``; ``dot``,
``amx``: loraserve's bfloat16 kernels), which needs no copy.
For a gated pair (a module's ``gated_groups``: Llama's gate/up) the kernels are timed on
``silu(gate) * up`` as a whole: each with the SiLU pass after it, and each that has an epilogue for
it with that, so the choice weighs the pass a kernel saves (``models/silu_epilogue.py``).

The choice is written to ``<cache>/cpu_gemm/<cpu signature>.json`` (keyed by the shape, torch's
thread count and version, and the digest of loraserve's kernel sources), so later starts on the
same kind of CPU read it instead of timing. A timing during which other processes kept the CPUs
busy (``cpu_load.OtherLoad``) is repeated once; if it is disturbed again its choice serves this
process (later engines in it reuse it) but is not written, so the next start times it again.
``GemmPolicy.kernel`` forces one kernel everywhere (``--cpu-gemm panels|onednn|torch|dot|amx``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from loraserve.config import CPU_GEMM_CHOICES
from loraserve.kernels import cpu_features
from loraserve.models.cpu_load import OtherLoad, best_alternating_passes
from loraserve.models.gemm_cache import ChoiceCache, GemmChoice, GemmPlan, GemmShape
from loraserve.models.packed_linear import (
    ROW_BUCKETS,
    UNPACKED,
    GemmKernel,
    PackedLinear,
    PackedLinearGroup,
    can_pack,
    can_run_silu_epilogue,
    kernels_for,
)
from loraserve.models.silu_epilogue import pick_gated, time_gated

logger = logging.getLogger(__name__)

GEMM_CHOICES = ("auto", *(k.value for k in GemmKernel))
assert GEMM_CHOICES == CPU_GEMM_CHOICES, "config.CPU_GEMM_CHOICES must list the GemmKernel values"
MAX_TIMED_LAYERS = 8  # layers of one shape timed back to back (meant to exceed the caches; a large L3 holds them)
TIE_TOLERANCE = 0.03  # timings this close are a tie (noise between passes is about that)
TIMING_ATTEMPTS = 2  # a timing disturbed by other processes is repeated once

# Choices timed under load in this process (not cached on disk), by cache key: later engines of
# the same process reuse them instead of timing again.
_DISTURBED_CHOICES: dict[str, GemmChoice] = {}


@dataclass(frozen=True)
class GemmPolicy:
    """How ``pack_linears`` picks kernels: ``kernel`` ``auto`` (timed, cached) or a ``GemmKernel``
    value for every layer; ``max_rows`` bounds the rows of any call (the step's token budget),
    ``row_limits`` lower it for named modules (the LM head sees one row per sequence);
    ``cache_dir`` None times at every start."""

    kernel: str = "auto"
    max_rows: int = 1024
    row_limits: tuple[tuple[str, int], ...] = ()
    cache_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.kernel not in GEMM_CHOICES:
            raise ValueError(f"cpu_gemm must be one of {GEMM_CHOICES}, got {self.kernel!r}")
        if self.max_rows < 1 or any(rows < 1 for _, rows in self.row_limits):
            raise ValueError("GemmPolicy row limits must be positive")

    def num_buckets(self, name: str) -> int:
        rows = min([self.max_rows] + [limit for module, limit in self.row_limits if module == name])
        return 1 + max(i for i, bucket in enumerate(ROW_BUCKETS) if i == 0 or ROW_BUCKETS[i - 1] < rows)


# A member list per layer that shares one shape, and the module names they stand for.
_Targets = dict[GemmShape, list[tuple[list[nn.Linear], Callable[[PackedLinearGroup], None]]]]


def pack_linears(model: nn.Module, policy: GemmPolicy) -> GemmPlan:
    """Run ``model``'s float32/bfloat16 CPU linear layers on the kernels ``policy`` picks.

    Every module with a ``fused_groups`` mapping (attribute name -> names of linear children that
    share an input) gets a ``PackedLinearGroup`` of those children under that attribute (those it
    names in ``gated_groups`` feed ``silu(y_1) * y_2``: their epilogue is timed too); every
    other ``nn.Linear`` child is replaced by a ``PackedLinear``. Leaves the model as it is when
    its weights cannot be packed; packing twice packs nothing more.
    """
    if policy.kernel not in ("auto", GemmKernel.TORCH.value):  # a forced kernel must run every layer
        forced = GemmKernel(policy.kernel)
        for layer in model.modules():
            if type(layer) is nn.Linear and forced not in kernels_for(layer.weight.dtype):
                raise ValueError(f"cpu_gemm={forced.value!r} cannot run {layer.weight.dtype} weights on this build")
    targets: _Targets = {}
    buckets: dict[GemmShape, int] = {}

    def add(
        members: list[nn.Linear], name: str, install: Callable[[PackedLinearGroup], None], gated: bool = False
    ) -> None:
        weight = members[0].weight
        shape = GemmShape(
            members[0].in_features,
            tuple(m.out_features for m in members),
            weight.dtype,
            any(m.bias is not None for m in members),
            gated and policy.kernel == "auto",  # a forced kernel runs as it is
        )
        targets.setdefault(shape, []).append((members, install))
        buckets[shape] = max(buckets.get(shape, 1), policy.num_buckets(name))

    grouped: set[int] = set()
    for module in model.modules():
        for attr, names in getattr(module, "fused_groups", {}).items():
            members = [getattr(module, name) for name in names]
            if isinstance(getattr(module, attr, None), PackedLinearGroup):  # packed already
                grouped.update(id(m) for m in members)
            elif all(type(m) is nn.Linear and can_pack(m.weight) for m in members):
                gated = attr in getattr(module, "gated_groups", ())
                add(members, attr, functools.partial(_set_group, module, attr), gated)
                grouped.update(id(m) for m in members)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and can_pack(child.weight) and id(child) not in grouped:
                add([child], name, functools.partial(_replace_linear, parent, name))
    plan = GemmPlan()
    if not targets:
        return plan
    choices, plan.source, plan.seconds, plan.disturbed = _choose(targets, buckets, policy)
    for shape, instances in targets.items():
        choice = choices[shape]
        plan.choices[shape.key] = choice.kernels
        if shape.gated:
            plan.silu_epilogue[shape.key] = choice.silu_epilogue
        for members, install in instances:
            group = PackedLinearGroup(members, choice.kernels, choice.silu_epilogue)
            plan.packed_bytes += group.packed_bytes()
            plan.num_layers += len(members)
            install(group)
    logger.info(
        "CPU GEMM kernels for %d linear layers (%s, %.1f s timing, %.0f MiB packed): %s",
        plan.num_layers,
        cpu_features.summary(),
        plan.seconds,
        plan.packed_bytes / 2**20,
        plan.summary(),
    )
    return plan


def _set_group(module: nn.Module, attr: str, group: PackedLinearGroup) -> None:
    setattr(module, attr, group)


def _replace_linear(parent: nn.Module, name: str, group: PackedLinearGroup) -> None:
    setattr(parent, name, PackedLinear(getattr(parent, name), group=group))


def _choose(
    targets: _Targets, buckets: dict[GemmShape, int], policy: GemmPolicy
) -> tuple[dict[GemmShape, GemmChoice], str, float, list[str]]:
    """Per shape its kernels, where they came from, seconds spent timing, and the shape keys
    whose timing other processes disturbed (used, not cached)."""
    if policy.kernel != "auto":
        forced = GemmKernel(policy.kernel)
        for shape in targets:
            if forced not in kernels_for(shape.dtype):
                raise ValueError(f"cpu_gemm={forced.value!r} cannot run {shape.dtype} weights on this build")
        return {shape: GemmChoice((forced,)) for shape in targets}, "forced", 0.0, []
    cache = ChoiceCache(policy.cache_dir)
    choices: dict[GemmShape, GemmChoice] = {}
    sources: set[str] = set()
    disturbed: list[str] = []
    seconds = 0.0
    for shape, instances in targets.items():
        cached = cache.get(shape, buckets[shape])
        earlier = _DISTURBED_CHOICES.get(cache.key(shape)) if policy.cache_dir is not None else None
        if cached is None and earlier is not None and len(earlier.kernels) >= buckets[shape]:
            cached = earlier.first(buckets[shape])
            disturbed.append(shape.key)
        if cached is not None:
            choices[shape] = cached
            sources.add("cached")
            continue
        start = time.perf_counter()
        members = [m for m, _ in instances[:MAX_TIMED_LAYERS]]
        rows = ROW_BUCKETS[: buckets[shape]]
        for _ in range(TIMING_ATTEMPTS):
            with OtherLoad() as load:
                choice, times, epilogue_times = _time_and_pick(shape, members, rows)
            if not load.disturbed:
                break
        seconds += time.perf_counter() - start
        choices[shape] = choice
        sources.add("measured")
        if load.disturbed:
            logger.warning(
                "the GEMM timing of %s was disturbed (other processes kept %.1f CPUs busy while it ran): "
                "its choice serves this process and is timed again at the next start",
                shape.key,
                load.cores,
            )
            disturbed.append(shape.key)
            _DISTURBED_CHOICES[cache.key(shape)] = choices[shape]
        else:
            cache.put(shape, choices[shape], times, epilogue_times)
    return choices, sources.pop() if len(sources) == 1 else "mixed", seconds, disturbed


def _time_and_pick(
    shape: GemmShape, members: Sequence[Sequence[nn.Linear]], rows: Sequence[int]
) -> tuple[GemmChoice, dict[GemmKernel, list[float]], dict[int, list[float]]]:
    """The shape's choice, the times it was made on, and for a gated shape the chosen kernels'
    seconds with the SiLU pass and with the epilogue per row count (where they have one)."""
    if not shape.gated or not can_run_silu_epilogue(shape.out_sizes, shape.dtype):
        times = time_kernels(members, rows, kernels_for(shape.dtype))
        return GemmChoice(pick_kernels(times), (False,) * len(rows) if shape.gated else ()), times, {}
    with_pass, with_epilogue = time_gated(members, rows, kernels_for(shape.dtype))
    times, epilogue = pick_gated(with_pass, with_epilogue)
    kernels = pick_kernels(times)
    silu_epilogue = tuple(epilogue[kernel][i] for i, kernel in enumerate(kernels))
    chosen = {
        count: [with_pass[kernel][i], with_epilogue[kernel][i]]
        for i, (count, kernel) in enumerate(zip(rows, kernels, strict=True))
        if kernel in with_epilogue
    }
    return GemmChoice(kernels, silu_epilogue), times, chosen


def time_kernels(
    instances: Sequence[Sequence[nn.Linear]], rows: Sequence[int], kernels: Sequence[GemmKernel]
) -> dict[GemmKernel, list[float]]:
    """Seconds for one pass over ``instances`` (layers of one shape) per kernel and row count:
    the best of several passes, the kernels' passes alternating (a drift of this machine's speed
    during the timing then slows every candidate alike instead of the one that ran then)."""
    in_features = instances[0][0].in_features
    dtype = instances[0][0].weight.dtype
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(r, in_features, generator=gen).to(dtype) for r in rows]  # each [r, in_features]
    times: dict[GemmKernel, list[float]] = {kernel: [] for kernel in kernels}
    with torch.no_grad():
        groups = {kernel: [PackedLinearGroup(members, (kernel,)) for members in instances] for kernel in kernels}
        for x in inputs:
            passes = {kernel: functools.partial(_one_pass, groups[kernel], kernel, x) for kernel in kernels}
            best = best_alternating_passes(passes)
            for kernel in kernels:
                times[kernel].append(best[kernel])
    return times


def _one_pass(groups: list[PackedLinearGroup], kernel: GemmKernel, x: torch.Tensor) -> float:
    start = time.perf_counter()
    for group in groups:
        group.run(kernel, x)
    return time.perf_counter() - start


def pick_kernels(times: dict[GemmKernel, list[float]]) -> tuple[GemmKernel, ...]:
    """Per bucket, the fastest of the kernels that need no copy (``UNPACKED``: ``torch``, ``dot``, ``amx``)
    and one packed kernel; the packed kernel is the one whose summed slowdown against each bucket's
    fastest candidate is smallest (one packed copy).

    Within ``TIE_TOLERANCE`` (timing noise) ``torch`` wins among the unpacked kernels, and an
    unpacked kernel wins over a packed one, since it needs no copy. So the copy is kept only for
    the buckets where it is more than that faster: one such bucket is enough (a prefill step runs
    its largest bucket, whatever the others gain)."""
    num_buckets = len(next(iter(times.values())))
    best = [min(t[i] for t in times.values()) for i in range(num_buckets)]
    unpacked = [kernel for kernel in UNPACKED if kernel in times]
    assert unpacked and unpacked[0] is GemmKernel.TORCH, "torch runs every shape: it is always timed"

    def plain(i: int) -> GemmKernel:  # bucket i's unpacked kernel: torch unless another beats it
        choice = unpacked[0]
        for kernel in unpacked[1:]:
            if times[kernel][i] * (1 + TIE_TOLERANCE) < times[choice][i]:
                choice = kernel
        return choice

    plains = tuple(plain(i) for i in range(num_buckets))

    def loss(kernels: tuple[GemmKernel, ...]) -> float:  # the summed slowdown against each bucket's best
        return sum(times[kernel][i] / best[i] for i, kernel in enumerate(kernels))

    def schedule(packed: GemmKernel) -> tuple[GemmKernel, ...]:
        near = 1 + TIE_TOLERANCE
        return tuple(k if times[k][i] <= times[packed][i] * near else packed for i, k in enumerate(plains))

    options = [schedule(k) for k in times if k not in UNPACKED]
    return min(options, key=loss) if options else plains
