"""Whether a kernel runs on AMX tiles or on vector loops, timed on this CPU (``lora/tile_choice.py``
per LoRA segment length, ``models/attention_choice.py`` for the prefill attention).

``TilePolicy`` is the option (``auto``, ``amx``, ``vector``); ``timed_choice`` reads a choice from
its ``ChoiceFile`` or times both ways and caches the result. A timing that other processes
disturbed (``cpu_load.OtherLoad``) is repeated once, and if disturbed again serves this process
without being cached: it is timed again at the next start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import torch

from loraserve.choice_file import ChoiceFile
from loraserve.config import CPU_TILE_CHOICES
from loraserve.kernels import cpu_features
from loraserve.models.cpu_load import OtherLoad

logger = logging.getLogger(__name__)

TIMING_ATTEMPTS = 2  # a timing disturbed by other processes is repeated once
V = TypeVar("V")


@dataclass(frozen=True)
class TilePolicy:
    """``kernel``: ``auto`` (timed, cached under ``cache_dir``; None: timed at every start),
    ``amx`` (the tiles; needs them) or ``vector`` (never the tiles). ``OPTION`` names the option."""

    kernel: str = "auto"
    cache_dir: Path | None = None
    OPTION: ClassVar[str] = "cpu_tiles"

    def __post_init__(self) -> None:
        if self.kernel not in CPU_TILE_CHOICES:
            raise ValueError(f"{self.OPTION} must be one of {CPU_TILE_CHOICES}, got {self.kernel!r}")

    def untimed(self, has_tiles: bool, dtype: torch.dtype, needs: str) -> tuple[bool, str] | None:
        """Whether the tiles run, and why (``forced``, or ``no tiles`` where they cannot), when that
        needs no timing; None when it does. ``amx`` where the tiles cannot run (they need ``needs`` on a
        CPU with AMX) is refused."""
        if self.kernel == "amx" and not has_tiles:
            raise ValueError(
                f"{self.OPTION}='amx' needs {needs} on a CPU with AMX tiles (amx_bf16, avx512_bf16) that the OS "
                f"grants; this is {dtype} on {cpu_features.summary()}"
            )
        if self.kernel != "auto":
            return self.kernel == "amx", "forced"
        return None if has_tiles else (False, "no tiles")


@dataclass(frozen=True)
class Timed(Generic[V]):
    """A choice and where it came from: ``measured``, ``cached`` or ``disturbed``."""

    value: V
    source: str
    seconds: float = 0.0  # spent timing
    ms: dict[str, list[float]] = field(default_factory=dict)  # per way: the timings


def timed_choice(
    cache: ChoiceFile,
    key: str,
    remembered: dict[str, Any],
    time_ways: Callable[[], dict[str, list[float]]],
    decide: Callable[[dict[str, list[float]]], V],
    read: Callable[[Any], V | None],
) -> Timed[V]:
    """The choice under ``key``: from ``cache`` (its ``tiles`` entry, which ``read`` turns back into
    a choice or None when it is not one), from ``remembered`` (choices of this process whose timing
    was disturbed), or ``decide``d from the seconds per way that ``time_ways`` measures."""
    cached = cache.get(key)
    value = read(cached["tiles"]) if isinstance(cached, dict) and "tiles" in cached else None
    if value is not None:
        return Timed(value, "cached", ms=_timings(cached.get("ms")))
    if cache.path is not None and key in remembered:
        return Timed(remembered[key], "disturbed")
    start = time.perf_counter()
    for _ in range(TIMING_ATTEMPTS):
        with OtherLoad() as load:
            times = time_ways()
        if not load.disturbed:
            break
    value = decide(times)
    ms = {way: [round(t * 1e3, 3) for t in ts] for way, ts in times.items()}
    seconds = time.perf_counter() - start
    if load.disturbed:
        logger.warning(
            "the %s timing was disturbed (other processes kept %.1f CPUs busy): its choice serves this process "
            "and is timed again at the next start",
            cache.kind,
            load.cores,
        )
        remembered[key] = value
        return Timed(value, "disturbed", seconds, ms)
    tiles = list(value) if isinstance(value, tuple) else value
    cache.put(key, {"tiles": tiles, "ms": ms, "cpu": cpu_features.summary()})
    return Timed(value, "measured", seconds, ms)


def _timings(entry: Any) -> dict[str, list[float]]:
    """A cache entry's ``ms`` as timings per way; {} where it is not that (a hand-edited file)."""
    if not isinstance(entry, dict):
        return {}
    return {
        way: [float(t) for t in ts]
        for way, ts in entry.items()
        if isinstance(way, str) and isinstance(ts, list) and all(isinstance(t, int | float) for t in ts)
    }
