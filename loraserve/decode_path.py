"""How a decode-only step with adapters runs when decode graphs are on, chosen by measurement.

Such a step can replay the padded decode graph with adapters by slot (``triton_lora_slots``), or
run eagerly with adapters by segment (``triton_lora``). Which is faster depends on the GPU, the
model and the adapters' ranks, so by default (``adapter_decode_path="auto"``) the runner times
both: for each padded batch size, the first such steps alternate between the two paths; each
path's first step is not counted (it compiles kernels, captures graphs); after ``trials`` timed
steps of each, the path whose fastest step took less time per sequence is kept for that size (a
later compilation or capture, when the slot tables grow, only makes a step slower, so the
fastest is the path's own cost). Steps without adapters always replay the graphs. ``graph`` or
``eager`` fixes the path instead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from enum import Enum

logger = logging.getLogger(__name__)


class DecodePath(str, Enum):
    GRAPH = "graph"  # the padded graph, adapters by slot
    EAGER = "eager"  # the eager forward, adapters by segment


ADAPTER_DECODE_PATHS = ("auto", DecodePath.GRAPH.value, DecodePath.EAGER.value)


class DecodePathChoice:
    """The path of each padded size's decode steps with adapters: fixed, or timed then fixed."""

    def __init__(self, mode: str = "auto", trials: int = 3, clock: Callable[[], float] = time.perf_counter) -> None:
        if mode not in ADAPTER_DECODE_PATHS:
            raise ValueError(f"adapter decode path must be one of {ADAPTER_DECODE_PATHS}, got {mode!r}")
        if trials < 1:
            raise ValueError(f"trials must be positive, got {trials}")
        self.fixed = None if mode == "auto" else DecodePath(mode)
        self.trials = trials
        self.clock = clock
        self.chosen: dict[int, DecodePath] = {}  # padded size -> the path measured faster
        self.measured_us: dict[int, tuple[float, float]] = {}  # padded size -> (graph, eager) us per sequence
        self._warmed: set[tuple[int, DecodePath]] = set()
        self._seconds: dict[tuple[int, DecodePath], list[float]] = {}  # per sequence, each timed step

    def path(self, size: int) -> DecodePath:
        """The path of the next decode step with adapters at padded ``size``."""
        if self.fixed is not None:
            return self.fixed
        chosen = self.chosen.get(size)
        if chosen is not None:
            return chosen
        graph, eager = (self._steps(size, path) for path in (DecodePath.GRAPH, DecodePath.EAGER))
        return DecodePath.GRAPH if graph <= eager else DecodePath.EAGER

    def settled(self, size: int) -> bool:
        """Whether steps at padded ``size`` no longer need timing (the path is fixed or chosen)."""
        return self.fixed is not None or size in self.chosen

    def record(self, size: int, path: DecodePath, started: float, num_seqs: int) -> None:
        """A step of ``num_seqs`` sequences at ``size`` ran on ``path`` from ``started`` (``clock()``)
        until its sampled tokens reached the host."""
        if self.settled(size):
            return
        seconds = self.clock() - started
        key = (size, path)
        if key not in self._warmed:
            self._warmed.add(key)
            return
        self._seconds.setdefault(key, []).append(seconds / num_seqs)
        timed = [self._seconds.get((size, p), []) for p in (DecodePath.GRAPH, DecodePath.EAGER)]
        if min(len(t) for t in timed) >= self.trials:
            graph_us, eager_us = (1e6 * min(t) for t in timed)
            self.measured_us[size] = (graph_us, eager_us)
            self.chosen[size] = DecodePath.GRAPH if graph_us <= eager_us else DecodePath.EAGER
            logger.info(
                "decode steps with adapters at batch size %d: %s (per sequence: graph %.1f us, eager %.1f us)",
                size,
                self.chosen[size].value,
                graph_us,
                eager_us,
            )

    def _steps(self, size: int, path: DecodePath) -> int:
        return len(self._seconds.get((size, path), [])) + ((size, path) in self._warmed)
