"""The cache of timed GEMM choices: one JSON file per CPU kind under ``<cache>/cpu_gemm/``.

Each entry is keyed by the layer shape (``GemmShape``), torch's thread count and version, the
digest of loraserve's kernel sources and ``CACHE_FORMAT`` (``choice_file.build_key``), so a new
build, a new torch or a new way of timing is timed anew; it keeps the timings it was chosen from
(``ms``) beside the choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.choice_file import ChoiceFile, build_key
from loraserve.kernels import cpu_features
from loraserve.models.packed_linear import ROW_BUCKETS, GemmKernel, kernels_for

CACHE_FORMAT = 2  # 2: only timings that no other process disturbed are written (cpu_load.py)


@dataclass(frozen=True)
class GemmShape:
    in_features: int
    out_sizes: tuple[int, ...]
    dtype: torch.dtype
    bias: bool

    @property
    def key(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype} {self.in_features}->{'+'.join(map(str, self.out_sizes))}{' +bias' if self.bias else ''}"


class ChoiceCache:
    """The GEMM choices of this CPU kind (``ChoiceFile``); unreadable or stale entries are timed again."""

    def __init__(self, directory: Path | None) -> None:
        self.file = ChoiceFile(directory, "GEMM")

    @staticmethod
    def key(shape: GemmShape) -> str:
        return build_key(shape.key, CACHE_FORMAT)

    def get(self, shape: GemmShape, num_buckets: int) -> tuple[GemmKernel, ...] | None:
        entry = self.file.get(self.key(shape))
        if not isinstance(entry, dict):
            return None
        try:
            kernels = tuple(GemmKernel(entry["kernels"][str(rows)]) for rows in ROW_BUCKETS[:num_buckets])
        except (KeyError, TypeError, ValueError):
            return None
        return kernels if set(kernels) <= set(kernels_for(shape.dtype)) else None

    def put(self, shape: GemmShape, kernels: tuple[GemmKernel, ...], times: dict[GemmKernel, list[float]]) -> None:
        entry = {
            "kernels": {str(ROW_BUCKETS[i]): k.value for i, k in enumerate(kernels)},
            "ms": {k.value: [t * 1e3 for t in ts] for k, ts in times.items()},
            "cpu": cpu_features.summary(),
        }
        self.file.put(self.key(shape), entry)
