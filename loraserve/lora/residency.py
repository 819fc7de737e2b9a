"""Adapter residency across three tiers: registry (disk or Redis), host memory, page pool.

* Requests name an adapter; ``resolver.py`` resolves the name once, at arrival, to the
  adapter's content digest (reading its files on a loader thread), and everything after that
  (residency, prefix-cache keys) uses the digest.
* A resident adapter's weights live in pages of the same pool as the KV cache,
  allocated from the same free list (``PageKind.ADAPTER``). Pages grow linearly with
  rank (see layout.py). This class only decides which pages: a new load's weights are
  handed to the scheduler (``take_loads``), which puts them into its batch for the runner
  to write; the runner owns the storage.
* An adapter used by running sequences is pinned (one pin per running sequence).
  When the last pin goes, its pages join the pool's single LRU of idle contents and
  are reclaimed when KV (or another adapter) needs them; using it again before that
  revives it without a copy.
* Parsed adapters are kept in host memory (``host_tier.py``): an LRU bounded in bytes that
  never drops adapters some unfinished request still needs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from loraserve.adapters import AdapterRegistry, LoRAAdapter
from loraserve.lora.batch import AdapterLoad, AdapterPages
from loraserve.lora.host_tier import HostTier
from loraserve.lora.layout import AdapterLayout
from loraserve.lora.resolver import AdapterResolver
from loraserve.page_pool import PageKind, PagePool

logger = logging.getLogger(__name__)


@dataclass
class ResidentAdapter:
    pages: AdapterPages
    num_pins: int = 0
    written: bool = True  # False after a step failed before its load was surely written

    @property
    def adapter_id(self) -> str:
        return self.pages.adapter_id

    @property
    def page_ids(self) -> list[int]:
        return list(self.pages.page_ids)

    @property
    def is_contiguous(self) -> bool:
        return self.pages.is_contiguous


class AdapterManager:
    def __init__(
        self,
        registry: AdapterRegistry,
        pool: PagePool,
        num_layers: int,
        page_elems: int,  # elements of one page in one layer
        host_cache_bytes: int,
        num_watermark_pages: int = 0,
        pages_per_adapter: int | None = None,
        parse_in_background: bool = False,
    ) -> None:
        """``pages_per_adapter``: every adapter takes that many pages, whatever its ranks (the
        slots of a fixed adapter region, ``pool`` then being that region); None: as many as
        its layout needs (the unified pool). ``parse_in_background``: parse read files on the
        loader thread too (see ``resolver.py``), not on the engine's."""
        self.pool = pool
        self.pages_per_adapter = pages_per_adapter
        self.num_layers, self.page_elems = num_layers, page_elems
        self.num_watermark_pages = num_watermark_pages
        self.host = HostTier(host_cache_bytes)
        # Names to digests (registry calls, the loader thread); its catalog thread starts now.
        self.resolver = AdapterResolver(registry, self.host, parse_in_background)
        self._layouts: dict[str, AdapterLayout] = {}  # of adapters in host memory or resident
        self.resident: dict[str, ResidentAdapter] = {}
        self._loads_to_write: list[AdapterLoad] = []  # taken by the scheduler into its batch
        self.num_loads = 0
        self.num_evictions = 0

    def close(self) -> None:
        """Stop the resolver's threads (reads in flight are dropped)."""
        self.resolver.close()

    # ---- resolving (the engine thread) ------------------------------------------------
    def resolve(self, name: str) -> str:
        """The content digest of the adapter registered as ``name``, waiting for its files."""
        return self._with_layout(self.resolver.resolve(name))

    def resolve_nowait(self, name: str) -> str | None:
        """The content digest of ``name``, or None while its files are being read
        (``AdapterResolver.resolve_nowait``, whose errors it raises)."""
        adapter_id = self.resolver.resolve_nowait(name)
        return None if adapter_id is None else self._with_layout(adapter_id)

    def _with_layout(self, adapter_id: str) -> str:
        if adapter_id not in self._layouts:  # resolved adapters are in host memory
            self._layouts[adapter_id] = AdapterLayout.for_adapter(self._adapter_weights(adapter_id), self.num_layers)
        return adapter_id

    def add_live_seq(self, adapter_id: str) -> None:
        """Count an unfinished sequence on the adapter (its host copy is kept meanwhile)."""
        self._forget_layouts(self.host.add_live_seq(adapter_id))

    def drop_live_seq(self, adapter_id: str) -> None:
        self._forget_layouts(self.host.drop_live_seq(adapter_id))

    def _forget_layouts(self, trimmed: list[str]) -> None:
        for adapter_id in trimmed:  # gone from host memory; a resident one keeps its layout until evicted
            if adapter_id not in self.resident:
                self._layouts.pop(adapter_id, None)

    def layout(self, adapter_id: str) -> AdapterLayout:
        return self._layouts[adapter_id]

    def num_pages(self, adapter_id: str) -> int:
        if self.pages_per_adapter is not None:
            return self.pages_per_adapter
        return self._layouts[adapter_id].num_pages(self.page_elems)

    def can_pin(self, adapter_id: str) -> bool:
        """Whether pinning the adapter fits its pool now (keeping the watermark free)."""
        return self.pool.can_allocate(self.num_pages_to_pin(adapter_id), reserve=self.num_watermark_pages)

    # ---- the pool tier --------------------------------------------------------------
    def num_pages_to_pin(self, adapter_id: str) -> int:
        """Pages that pinning the adapter takes from what allocations can get.

        Zero if it is already pinned; otherwise its size, whether it must be loaded or is
        idle (reviving takes its pages out of the evictable set).
        """
        resident = self.resident.get(adapter_id)
        if resident is not None and resident.num_pins > 0:
            return 0
        return self.num_pages(adapter_id)

    def acquire(self, adapter_id: str) -> bool:
        """Pin the adapter for one running sequence, allocating its pages if it is not resident
        (its weights then wait in ``take_loads`` for the runner to write them).

        Returns False, changing nothing, when the pool cannot make room while keeping
        the watermark free.
        """
        resident = self.resident.get(adapter_id)
        if resident is not None:
            if resident.num_pins == 0 and self.pool.take_evictable(("adapter", adapter_id)) is None:
                raise RuntimeError(f"idle adapter {adapter_id[:12]} lost its pages")
            resident.num_pins += 1
            return True
        num_pages = self.num_pages(adapter_id)
        if not self.pool.can_allocate(num_pages, reserve=self.num_watermark_pages):
            return False
        page_ids = self.pool.allocate_contiguous(num_pages, PageKind.ADAPTER)
        if page_ids is None:
            page_ids = self.pool.allocate(num_pages, PageKind.ADAPTER)
        resident = ResidentAdapter(AdapterPages(adapter_id, tuple(page_ids), self._layouts[adapter_id]), num_pins=1)
        self._loads_to_write.append(AdapterLoad(resident.pages, self._adapter_weights(adapter_id)))
        self.resident[adapter_id] = resident
        self.num_loads += 1
        logger.debug("loaded adapter %s into %d pages", adapter_id[:12], num_pages)
        return True

    def release(self, adapter_id: str) -> None:
        """Drop one pin; an unpinned adapter stays resident but evictable (freed, if its weights
        may not have been written: ``unwritten``)."""
        resident = self.resident[adapter_id]
        resident.num_pins -= 1
        if resident.num_pins == 0 and not resident.written:
            self.pool.release(resident.page_ids)
            self._evicted(adapter_id)
        elif resident.num_pins == 0:
            unreferenced = self.pool.decref(resident.page_ids)
            assert len(unreferenced) == len(resident.page_ids)
            self.pool.add_evictable(
                ("adapter", adapter_id), resident.page_ids, PageKind.ADAPTER_IDLE, lambda: self._evicted(adapter_id)
            )

    def _evicted(self, adapter_id: str) -> None:
        self.resident.pop(adapter_id)
        self.num_evictions += 1
        if adapter_id not in self.host:
            self._layouts.pop(adapter_id, None)

    def _adapter_weights(self, adapter_id: str) -> LoRAAdapter:
        adapter = self.host.get(adapter_id)
        if adapter is None:
            raise RuntimeError(f"adapter {adapter_id[:12]} is neither resident nor in host memory")
        return adapter

    def unwritten(self, loads: list[AdapterLoad]) -> None:
        """A step that carried these loads failed, perhaps before writing them: their pages may hold
        no weights. Such an adapter is never served from them: the next step that uses it loads it
        again (``pages_for_step``), and its last release frees its pages instead of keeping them idle."""
        for load in loads:
            resident = self.resident.get(load.pages.adapter_id)
            if resident is not None and resident.pages == load.pages:
                resident.written = False

    def take_loads(self) -> list[AdapterLoad]:
        """The loads acquired since the last call, in order (for the scheduler's batch)."""
        loads, self._loads_to_write = self._loads_to_write, []
        return loads

    def pages(self, adapter_id: str) -> AdapterPages:
        """Where the resident adapter ``adapter_id`` sits (it must be pinned)."""
        return self.resident[adapter_id].pages

    def pages_for_step(self, adapter_id: str) -> AdapterPages:
        """``pages``, for a step's batch: an adapter whose load a failed step carried is loaded
        again into the same pages (the load joins ``take_loads``, so call that after)."""
        resident = self.resident[adapter_id]
        if not resident.written:
            self._loads_to_write.append(AdapterLoad(resident.pages, self._adapter_weights(adapter_id)))
            resident.written = True
            self.num_loads += 1
        return resident.pages
