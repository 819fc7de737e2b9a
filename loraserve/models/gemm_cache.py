"""The cache of timed GEMM choices: one JSON file per CPU kind under ``<cache>/cpu_gemm/``.

Each entry is keyed by the layer shape (``GemmShape``), torch's thread count and version, the
digest of loraserve's kernel sources and ``CACHE_FORMAT``, so a new build, a new torch or a new
way of timing is timed anew; it keeps the timings it was chosen from (``ms``) beside the choice.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loraserve.kernels import cpu, cpu_features
from loraserve.models.packed_linear import ROW_BUCKETS, GemmKernel, kernels_for

logger = logging.getLogger(__name__)

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
    """The choices of this CPU kind in one JSON file; unreadable or stale entries are timed again."""

    def __init__(self, directory: Path | None) -> None:
        self.path = directory / f"{cpu_features.signature()}.json" if directory is not None else None
        self.entries: dict[str, Any] = {}
        if self.path is not None and self.path.exists():
            try:
                self.entries = json.loads(self.path.read_text())
            except (OSError, ValueError) as error:
                logger.warning("ignoring the GEMM choice cache %s: %s", self.path, error)

    @staticmethod
    def key(shape: GemmShape) -> str:
        # a new build of loraserve's kernels (sources changed) or of torch is timed anew
        build = cpu.source_digest()
        versions = f"torch={torch.__version__} | kernels={build} | format={CACHE_FORMAT}"
        return f"{shape.key} | threads={torch.get_num_threads()} | {versions}"

    def get(self, shape: GemmShape, num_buckets: int) -> tuple[GemmKernel, ...] | None:
        entry = self.entries.get(self.key(shape))
        if not isinstance(entry, dict):
            return None
        try:
            kernels = tuple(GemmKernel(entry["kernels"][str(rows)]) for rows in ROW_BUCKETS[:num_buckets])
        except (KeyError, TypeError, ValueError):
            return None
        return kernels if set(kernels) <= set(kernels_for(shape.dtype)) else None

    def put(self, shape: GemmShape, kernels: tuple[GemmKernel, ...], times: dict[GemmKernel, list[float]]) -> None:
        if self.path is None:
            return
        self.entries[self.key(shape)] = {
            "kernels": {str(ROW_BUCKETS[i]): k.value for i, k in enumerate(kernels)},
            "ms": {k.value: [t * 1e3 for t in ts] for k, ts in times.items()},
            "cpu": cpu_features.summary(),
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps(self.entries, indent=1))
            scratch.replace(self.path)  # atomic: a concurrent start reads the old or the new file
        except OSError as error:
            logger.warning("could not write the GEMM choice cache %s: %s", self.path, error)
