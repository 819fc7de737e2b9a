"""Adapter residency across three tiers: registry (disk or Redis), host memory, page pool.

* Requests name an adapter; it is resolved once, at arrival, to the adapter's content
  digest, and everything after that (residency, prefix-cache keys) uses the digest.
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
* Reading an adapter that is not in host memory from the store runs on a background thread
  (``resolve_nowait``), so the engine keeps stepping while the files arrive (S-LoRA's
  asynchronous adapter loading); the engine holds the request back until then. Parsing (the
  safetensors copy, the finiteness check, the content digest) runs there too when
  ``parse_in_background``: where the forward leaves host cores idle (a GPU engine, or a CPU engine
  with fewer torch threads than cores). Otherwise it stays on the engine's thread: torch ops on a
  second thread start a second OpenMP team, which on a machine whose cores the engine already
  fills slowed the steps by a quarter.
* No registry call runs on the engine thread. Names resolve through the store's catalog
  (``adapters/catalog.py``): an in-memory name -> content key map that a background thread keeps
  current (Redis: pub/sub), so a delete or re-registration anywhere reaches every replica
  without a round trip per request (a directory store's lookup reads the name's link: one
  system call, as before). Content keys name immutable content, so the key -> digest map here
  never goes stale; requests already running keep the digest they resolved. With the registry
  unreachable, adapters in host memory (and so in the pool) keep being served; a request that
  needs the store fails with ``RegistryUnavailableError`` (HTTP 503).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from loraserve.adapters import (
    AdapterError,
    AdapterInfo,
    AdapterNotFoundError,
    AdapterRegistry,
    LoRAAdapter,
    RegistryUnavailableError,
)
from loraserve.lora.adapter_source import AdapterSource
from loraserve.lora.batch import AdapterLoad, AdapterPages
from loraserve.lora.host_tier import HostTier
from loraserve.lora.layout import AdapterLayout
from loraserve.page_pool import PageKind, PagePool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Read:
    """A read of an adapter's files in flight on the loader thread; the future gives the content
    key actually read (the name may have moved on meanwhile) and the files."""

    key: str
    future: Future[tuple[str, Mapping[str, bytes] | LoRAAdapter]]  # files, or parsed in the background


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
        loader thread too (see the module's docstring), not on the engine's."""
        self.registry = registry
        self.pool = pool
        self.pages_per_adapter = pages_per_adapter
        self.num_layers, self.page_elems = num_layers, page_elems
        self.num_watermark_pages = num_watermark_pages
        self.parse_in_background = parse_in_background
        self.source = AdapterSource(registry)  # its catalog thread starts now; close() stops it
        self.host = HostTier(host_cache_bytes)
        self._layouts: dict[str, AdapterLayout] = {}  # of adapters in host memory or resident
        self.resident: dict[str, ResidentAdapter] = {}
        self._loads_to_write: list[AdapterLoad] = []  # taken by the scheduler into its batch
        self._loads: dict[str, _Read] = {}  # name -> the read of its files in flight on the loader thread
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraserve-adapter-load")
        self._unavailable: set[str] = set()  # names whose last resolve failed for want of the registry
        self.num_loads = 0
        self.num_evictions = 0

    # ---- names (any thread but the engine's: these wait on the registry) ----------------
    def register(self, name: str, files: Mapping[str, bytes], overwrite: bool = False) -> AdapterInfo:
        return self.source.register(name, files, overwrite=overwrite)

    def register_from_path(self, name: str, path: str, overwrite: bool = False) -> AdapterInfo:
        return self.source.register_from_path(name, path, overwrite=overwrite)

    def remove(self, name: str) -> None:
        """Unregister; requests already holding the adapter's digest keep running on it."""
        self.source.remove(name)

    def info(self, name: str) -> AdapterInfo:
        """Summary of ``name``, parsed once per stored content."""
        return self.source.info(name)

    @property
    def registry_up(self) -> bool:
        """Whether the registry answers and this replica follows its changes (the catalog is current)."""
        return self.source.up

    @property
    def num_registered(self) -> int:
        """Registered adapters as this replica last saw them (no I/O)."""
        return self.source.num_registered

    def error_code(self, name: str | None) -> str | None:
        """``RegistryUnavailableError.code`` if the last resolve of ``name`` failed for want of the
        registry (how the engine tells a client to retry later), else None."""
        return RegistryUnavailableError.code if name in self._unavailable else None

    def close(self) -> None:
        """Stop following the registry and the loader thread (reads in flight are dropped)."""
        self.source.close()
        self._loader.shutdown(wait=False, cancel_futures=True)

    # ---- resolving (the engine thread) ------------------------------------------------
    def resolve(self, name: str) -> str:
        """The content digest of the adapter registered as ``name`` (loaded into host memory)."""
        adapter_id = self.resolve_nowait(name)
        while adapter_id is None:
            self.wait_for_load(name)
            adapter_id = self.resolve_nowait(name)
        return adapter_id

    def resolve_nowait(self, name: str) -> str | None:
        """Like :meth:`resolve`, but None while the adapter's files are being read.

        No I/O: the name goes through the catalog; the first call for an adapter not in host memory
        starts reading its files on the loader thread; a later call after the read finished parses
        them and takes the adapter in. Raises ``AdapterNotFoundError`` at once for a name that is
        not registered, ``RegistryUnavailableError`` at once when the adapter is not in host memory
        and the registry is unreachable, and the read's or the parse's error (an ``AdapterError``)
        if either failed.
        """
        read = self._loads.get(name)
        if read is not None and not read.future.done():
            return None  # polled every step while loading
        self._unavailable.discard(name)
        try:
            return self._resolve(name, read)
        except RegistryUnavailableError:
            self._unavailable.add(name)
            raise

    def _resolve(self, name: str, read: _Read | None) -> str | None:
        key = self.source.lookup(name)
        if read is not None:
            del self._loads[name]
            if key == read.key:
                if read.future.cancelled():  # close() dropped it
                    raise AdapterError(f"reading adapter {name!r} was cancelled: the adapter manager is closed")
                return self._take_in(name, *read.future.result())  # raises the read's error
            # Otherwise the name moved on (deleted or re-registered) while its files were read.
        if key is None:
            if not self.source.up:
                raise self.source.unavailable_error(f"adapter {name!r} cannot be looked up")
            raise AdapterNotFoundError(f"adapter {name!r} not found")
        digest = self.host.digest_of_key(key)
        if digest is not None:
            return digest
        if not self.source.up:
            raise self.source.unavailable_error(f"adapter {name!r} is not loaded on this replica")
        work = self._read_and_parse if self.parse_in_background else self.source.read
        self._loads[name] = _Read(key, self._loader.submit(work, name, key))
        return None

    def _read_and_parse(self, name: str, key: str) -> tuple[str, LoRAAdapter]:
        """The loader thread's work when parsing in the background."""
        key, files = self.source.read(name, key)
        return key, self.registry.parse(name, files)

    def _take_in(self, name: str, key: str, read: Mapping[str, bytes] | LoRAAdapter) -> str:
        adapter = read if isinstance(read, LoRAAdapter) else self.registry.parse(name, read)
        self.host.put(key, adapter)
        if adapter.digest not in self._layouts:
            self._layouts[adapter.digest] = AdapterLayout.for_adapter(adapter, self.num_layers)
        return adapter.digest

    def wait_for_load(self, name: str, timeout: float | None = None) -> None:
        """Block until the read of ``name`` in flight (if any) is done, or ``timeout`` seconds."""
        read = self._loads.get(name)
        if read is not None:
            wait([read.future], timeout=timeout)

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
