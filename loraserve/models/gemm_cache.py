"""The timed GEMM choices: per layer shape (``GemmChoice``), for the whole model (``GemmPlan``), and
their cache, one JSON file per CPU kind under ``<cache>/cpu_gemm/``.

Each entry is keyed by the layer shape (``GemmShape``), torch's thread count and version, the
digest of loraserve's kernel sources and ``CACHE_FORMAT`` (``choice_file.build_key``), so a new
build, a new torch or a new way of timing is timed anew; it keeps the timings it was chosen from
(``ms``) beside the choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loraserve.choice_file import ChoiceFile, build_key
from loraserve.kernels import cpu_features
from loraserve.models.packed_linear import ROW_BUCKETS, GemmKernel, kernels_for, silu_epilogue_kernels

# 2: only timings that no other process disturbed are written (cpu_load.py); 3: a packed copy is
# kept where it wins one row bucket clearly (pick_kernels)
CACHE_FORMAT = 3


@dataclass(frozen=True)
class GemmShape:
    in_features: int
    out_sizes: tuple[int, ...]
    dtype: torch.dtype
    bias: bool
    gated: bool = False  # the outputs feed silu(y_1) * y_2 (a gated MLP): the SiLU epilogue is timed too

    @property
    def key(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        bias, gated = " +bias" if self.bias else "", " gated" if self.gated else ""
        return f"{dtype} {self.in_features}->{'+'.join(map(str, self.out_sizes))}{bias}{gated}"


@dataclass(frozen=True)
class GemmChoice:
    """A shape's kernel per row bucket and, for a gated shape, whether each bucket runs SiLU-and-mul
    in the GEMMs' epilogues (``models/silu_epilogue.py``; () for other shapes)."""

    kernels: tuple[GemmKernel, ...]
    silu_epilogue: tuple[bool, ...] = ()

    def first(self, num_buckets: int) -> GemmChoice:
        """The choice for the first ``num_buckets`` row buckets."""
        return GemmChoice(self.kernels[:num_buckets], self.silu_epilogue[:num_buckets])


class ChoiceCache:
    """The GEMM choices of this CPU kind (``ChoiceFile``); unreadable or stale entries are timed again."""

    def __init__(self, directory: Path | None) -> None:
        self.file = ChoiceFile(directory, "GEMM")

    @staticmethod
    def key(shape: GemmShape) -> str:
        return build_key(shape.key, CACHE_FORMAT)

    def get(self, shape: GemmShape, num_buckets: int) -> GemmChoice | None:
        entry = self.file.get(self.key(shape))
        if not isinstance(entry, dict):
            return None
        buckets = ROW_BUCKETS[:num_buckets]
        try:
            kernels = tuple(GemmKernel(entry["kernels"][str(rows)]) for rows in buckets)
            epilogue = entry.get("silu_epilogue", {}) if shape.gated else {}
            silu_epilogue = tuple(epilogue[str(rows)] for rows in buckets) if shape.gated else ()
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        if not set(kernels) <= set(kernels_for(shape.dtype)) or not all(isinstance(on, bool) for on in silu_epilogue):
            return None
        fusing = silu_epilogue_kernels(shape.dtype)
        if any(on and k not in fusing for on, k in zip(silu_epilogue, kernels, strict=False)):
            return None
        return GemmChoice(kernels, silu_epilogue)

    def put(
        self,
        shape: GemmShape,
        choice: GemmChoice,
        times: dict[GemmKernel, list[float]],
        epilogue_times: dict[int, list[float]],
    ) -> None:
        entry: dict[str, object] = {
            "kernels": {str(ROW_BUCKETS[i]): k.value for i, k in enumerate(choice.kernels)},
            "ms": {k.value: [t * 1e3 for t in ts] for k, ts in times.items()},
            "cpu": cpu_features.summary(),
        }
        if shape.gated:
            entry["silu_epilogue"] = {str(ROW_BUCKETS[i]): on for i, on in enumerate(choice.silu_epilogue)}
            entry["silu_epilogue_ms"] = {str(rows): [t * 1e3 for t in ts] for rows, ts in epilogue_times.items()}
        self.file.put(self.key(shape), entry)


@dataclass
class GemmPlan:
    """What ``pack_linears`` decided: per shape key, the kernel of each row bucket (and for a gated
    shape the buckets that run SiLU-and-mul in the epilogues)."""

    choices: dict[str, tuple[GemmKernel, ...]] = field(default_factory=dict)
    silu_epilogue: dict[str, tuple[bool, ...]] = field(default_factory=dict)  # gated shapes only
    source: str = "none"  # forced | measured | cached | mixed | none
    seconds: float = 0.0  # spent timing
    packed_bytes: int = 0  # the packed copies kept beside the model's weights
    num_layers: int = 0
    disturbed: list[str] = field(default_factory=list)  # shape keys timed while other processes ran

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "cpu": cpu_features.summary(),
            "timing_seconds": round(self.seconds, 2),
            "packed_mib": round(self.packed_bytes / 2**20, 1),
            "disturbed": list(self.disturbed),
            "layers": {
                key: {str(ROW_BUCKETS[i]): k.value for i, k in enumerate(kernels)}
                for key, kernels in self.choices.items()
            },
            "silu_epilogue_rows": {key: self.epilogue_rows(key) for key in self.silu_epilogue},
        }

    def epilogue_rows(self, key: str) -> list[int]:
        """The row buckets where shape ``key`` runs SiLU-and-mul in the GEMMs' epilogues."""
        return [ROW_BUCKETS[i] for i, on in enumerate(self.silu_epilogue.get(key, ())) if on]

    def summary(self) -> str:
        def shown(key: str, kernels: tuple[GemmKernel, ...]) -> str:
            rows = self.epilogue_rows(key)
            return "/".join(k.value for k in kernels) + (f", SiLU-and-mul in the epilogue at {rows}" if rows else "")

        return f"{self.source}; " + "; ".join(f"{key}: {shown(key, ks)}" for key, ks in self.choices.items())
