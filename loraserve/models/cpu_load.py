"""Timing kernels on a shared CPU: how much CPU time other processes took while this one timed
something, and the best time of alternating passes (``best_alternating_passes``).

A kernel timing taken while another process runs on the same cores measures the contention, not
the kernel (OpenMP threads wait for the one that lost its core), and a choice made from it would
be cached for good. ``OtherLoad`` reads the machine's busy time
(``/proc/stat``: user, nice, system, irq, softirq and steal, which on a VM is time the host gave to
others) and this process's CPU time around a block; the difference is what everything else used.
Where ``/proc/stat`` is missing (not Linux) it reports nothing and nothing counts as disturbed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TypeVar

K = TypeVar("K")
PROC_STAT = Path("/proc/stat")
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system (idle iowait) irq softirq steal, of the "cpu" line
DISTURBED_CORES = 0.25  # others used at least a quarter of a core on average: the timing is not clean


def _machine_busy_seconds() -> float | None:
    try:
        first = PROC_STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not first or first[0] != "cpu" or len(first) < 9:
        return None
    ticks = sum(int(first[1 + i]) for i in BUSY_FIELDS)
    return ticks / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system


class OtherLoad:
    """Context manager: ``cores`` is the average number of CPUs other processes kept busy while
    the block ran (None where it cannot be read); ``disturbed`` whether that reached
    ``DISTURBED_CORES``."""

    def __init__(self) -> None:
        self.cores: float | None = None
        self._start: tuple[float | None, float, float] | None = None

    def __enter__(self) -> OtherLoad:
        self._start = (_machine_busy_seconds(), _own_seconds(), time.monotonic())
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        assert self._start is not None, "OtherLoad used without entering it"
        busy_start, own_start, wall_start = self._start
        busy_end, own_end, wall_end = _machine_busy_seconds(), _own_seconds(), time.monotonic()
        wall = wall_end - wall_start
        if busy_start is None or busy_end is None or wall <= 0:
            return
        others = (busy_end - busy_start) - (own_end - own_start)  # seconds of CPU, all cores
        self.cores = max(0.0, others / wall)

    @property
    def disturbed(self) -> bool:
        return self.cores is not None and self.cores >= DISTURBED_CORES


MIN_PASS_SECONDS = 0.02  # per candidate, passes are repeated until at least this long in total
MIN_PASSES, MAX_PASSES = 3, 50


def best_alternating_passes(passes: Mapping[K, Callable[[], float]]) -> dict[K, float]:
    """Each candidate's best time of one pass (``passes[k]()`` runs one and returns its seconds),
    after one warm-up pass each (first-call costs: page faults, primitive creation), the candidates'
    passes alternating, so that a drift of the machine's speed slows every candidate alike instead
    of the one that ran then; at least ``MIN_PASSES`` rounds, more while they took less than
    ``MIN_PASS_SECONDS`` per candidate in all (at most ``MAX_PASSES``)."""
    for run in passes.values():
        run()
    best = dict.fromkeys(passes, float("inf"))
    total, rounds = 0.0, 0
    while rounds < MIN_PASSES or (total < MIN_PASS_SECONDS * len(passes) and rounds < MAX_PASSES):
        for key, run in passes.items():
            elapsed = run()
            best[key] = min(best[key], elapsed)
            total += elapsed
        rounds += 1
    return best
