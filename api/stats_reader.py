"""The engine's stats for ``/health`` and ``/metrics`` without waiting out a long step.

The stats are read on the engine thread between steps (``AsyncEngine.call``), so they are
exact; but a CPU prefill step can take seconds, and a load balancer's or Kubernetes' probe
gives up after one. So a read waits at most ``wait_s``: past it the route answers with the last
stats read, and the read still in flight refreshes them when the step ends. An idle engine
answers at once, so tests and scrapes of an idle server see exact values.
"""

from __future__ import annotations

import asyncio

from loraserve.llm_engine import LLMEngine
from loraserve.stats import EngineStats

from .async_engine import AsyncEngine


class StatsReader:
    """One per app; its methods run on the event loop."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        self.async_engine = async_engine
        self._last: EngineStats | None = None
        self._pending: asyncio.Future[EngineStats] | None = None  # a read waiting for the step to end

    async def read(self, wait_s: float) -> EngineStats | None:
        """The engine's stats, read between steps; past ``wait_s`` seconds the last ones read
        (None before the first). Raises ``EngineDeadError`` when the engine loop has stopped."""
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self.async_engine.call(LLMEngine.stats))
            self._pending.add_done_callback(self._keep)
        try:
            return await asyncio.wait_for(asyncio.shield(self._pending), wait_s)
        except TimeoutError:
            return self._last

    def _keep(self, read: asyncio.Future[EngineStats]) -> None:
        if read.cancelled() or read.exception() is not None:  # retrieved: a late failure is not logged as lost
            return
        self._last = read.result()
