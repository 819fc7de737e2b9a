"""Accounting of the unified page pool: free list, refcounts and one LRU of idle contents.

The pool's storage is one preallocated tensor ``[num_layers, num_pages, page_elems]``
owned by the model runner (see docs/design.md); this class only decides which page
ids are in use. A page id names the same slot in every layer. Pages are used by

* KV blocks of running sequences (``PageKind.KV``),
* weights of resident adapters (``PageKind.ADAPTER``),
* cached prefix blocks and idle adapters that nobody references any more: these are
  *evictable*. They stay in one least-recently-used order and are reclaimed, oldest
  first, only when the free list cannot satisfy an allocation.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)


class PageKind(str, enum.Enum):
    """What a page holds: the one vocabulary of pool accounting, ``/metrics`` and benchmarks."""

    FREE = "free"
    KV = "kv"  # a KV block of a running (or swapped-in) sequence
    ADAPTER = "adapter"  # weights of an adapter pinned by running sequences
    PREFIX_CACHE = "prefix_cache"  # a cached KV block nobody references (evictable)
    ADAPTER_IDLE = "adapter_idle"  # weights of a resident adapter nobody pins (evictable)


EVICTABLE_KINDS = (PageKind.PREFIX_CACHE, PageKind.ADAPTER_IDLE)


class OutOfPagesError(RuntimeError):
    """An allocation asked for more pages than are free or evictable."""


@dataclass
class EvictableEntry:
    """Pages kept for reuse while unreferenced; ``on_evict`` forgets them when reclaimed."""

    page_ids: list[int]
    kind: PageKind  # one of EVICTABLE_KINDS
    on_evict: Callable[[], None]


class PagePool:
    """Page ids ``0..num_pages-1``, handed out lowest-first on a fresh pool.

    Freed pages go to the back of the free list. Allocation takes from the front of
    the free list, then evicts least-recently-used idle entries.

    ``page_ids`` makes a pool of a part of the storage's pages instead (the fixed adapter
    region of ``adapter_region="fixed"`` and the KV pages beside it); ``num_pages`` is then
    the size of that part.
    """

    def __init__(self, num_pages: int, page_ids: range | None = None) -> None:
        if page_ids is None:
            page_ids = range(num_pages)
        if num_pages < 1 or len(page_ids) != num_pages or page_ids.start < 0 or page_ids.step != 1:
            raise ValueError(f"num_pages must be positive and page_ids a range of that many ids, got {num_pages}")
        self.num_pages = num_pages
        self.page_ids = page_ids
        # Free page ids in allocation order. A run taken by ``allocate_contiguous`` stays in the list
        # as stale entries (``_stale``), skipped when they come to the front, so a run costs no
        # rebuild of the list. A stale entry is always older than the page's valid one (a page
        # re-enters the list only when freed after the run took it), so order is kept exactly.
        self._free_page_ids: deque[int] = deque(page_ids)
        self._stale: dict[int, int] = {}  # page id -> its stale entries in the free list
        self._num_stale = 0
        self._is_free = np.zeros(page_ids.stop, dtype=np.bool_)  # [page_ids.stop], by page id
        self._is_free[page_ids.start :] = True
        self._ref_counts = [0] * page_ids.stop  # indexed by page id: ids below the range stay unused
        self._kinds: list[PageKind | None] = [None] * page_ids.stop
        self._evictable: OrderedDict[Hashable, EvictableEntry] = OrderedDict()
        self._evictable_page_ids: set[int] = set()
        self._num_evictable_pages = 0
        self.num_evictions: dict[PageKind, int] = dict.fromkeys(EVICTABLE_KINDS, 0)

    # ---- counts -------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free_page_ids) - self._num_stale

    @property
    def num_evictable_pages(self) -> int:
        return self._num_evictable_pages

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation can get: free ones plus evictable ones."""
        return self.num_free_pages + self._num_evictable_pages

    def num_pages_by_kind(self) -> dict[PageKind, int]:
        """Pages of every kind (they add up to ``num_pages``)."""
        counts = dict.fromkeys(PageKind, 0)
        for page_id, kind in enumerate(self._kinds):
            if kind is not None and self._ref_counts[page_id] > 0:
                counts[kind] += 1
        for entry in self._evictable.values():
            counts[entry.kind] += len(entry.page_ids)
        counts[PageKind.FREE] = self.num_free_pages
        return counts

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def can_allocate(self, num_pages: int, reserve: int = 0) -> bool:
        return num_pages + reserve <= self.num_available_pages

    # ---- allocation -----------------------------------------------------------------
    def allocate(self, num_pages: int, kind: PageKind = PageKind.KV) -> list[int]:
        """Take ``num_pages`` pages with refcount 1, evicting idle entries if needed."""
        if num_pages > self.num_available_pages:
            raise OutOfPagesError(
                f"need {num_pages} pages, only {self.num_available_pages} free or evictable of {self.num_pages}"
            )
        while self.num_free_pages < num_pages:
            self.evict_oldest()
        page_ids: list[int] = []
        while len(page_ids) < num_pages:
            page_id = self._free_page_ids.popleft()
            if self._stale and page_id in self._stale:
                self._drop_stale(page_id)
                continue
            page_ids.append(page_id)
            self._ref_counts[page_id] = 1
            self._kinds[page_id] = kind
            self._is_free[page_id] = False
        return page_ids

    def allocate_contiguous(self, num_pages: int, kind: PageKind = PageKind.ADAPTER) -> list[int] | None:
        """Take a run of consecutive free page ids if one exists (no eviction), else None.

        Consecutive ids are consecutive in every layer of the storage tensor, so the
        caller can view them without a copy.
        """
        if num_pages == 0:
            return []
        if num_pages > self.num_free_pages:
            return None
        # Vectorised over the pool's pages: a pool may hold ~10^5 of them on a GPU, and this runs
        # per adapter load.
        edges = np.diff(self._is_free.view(np.int8), prepend=0, append=0)  # [stop + 1]: +1 at a run, -1 past it
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # [runs] each
        fits = np.flatnonzero(ends - starts >= num_pages)
        if not fits.size:
            return None
        first = int(starts[fits[0]])  # the lowest run that fits
        page_ids = list(range(first, first + num_pages))
        self._is_free[first : first + num_pages] = False
        for page_id in page_ids:
            self._ref_counts[page_id] = 1
            self._kinds[page_id] = kind
            self._stale[page_id] = self._stale.get(page_id, 0) + 1
        self._num_stale += num_pages
        if self._num_stale > max(64, len(self._free_page_ids) // 2):
            self._compact_free_list()
        return page_ids

    def _drop_stale(self, page_id: int) -> None:
        """Forget one stale free-list entry of ``page_id`` (just removed from the list)."""
        remaining = self._stale[page_id] - 1
        if remaining:
            self._stale[page_id] = remaining
        else:
            del self._stale[page_id]
        self._num_stale -= 1

    def _compact_free_list(self) -> None:
        """Drop every stale entry (amortised: runs only once they are half the list)."""
        kept: deque[int] = deque()
        for page_id in self._free_page_ids:
            if self._stale and page_id in self._stale:
                self._drop_stale(page_id)
            else:
                kept.append(page_id)
        self._free_page_ids = kept

    def incref(self, page_ids: Iterable[int]) -> None:
        for page_id in page_ids:
            if self._ref_counts[page_id] <= 0:
                raise RuntimeError(f"incref of page {page_id} that is not allocated")
            self._ref_counts[page_id] += 1

    def decref(self, page_ids: Iterable[int]) -> list[int]:
        """Drop one reference from each page; return the pages now unreferenced.

        The caller either frees those pages or hands them to ``add_evictable``.
        """
        unreferenced: list[int] = []
        for page_id in page_ids:
            if self._ref_counts[page_id] <= 0:
                raise RuntimeError(f"decref of page {page_id} that is not allocated")
            self._ref_counts[page_id] -= 1
            if self._ref_counts[page_id] == 0:
                unreferenced.append(page_id)
        return unreferenced

    def free(self, page_ids: Iterable[int]) -> None:
        """Return unreferenced pages to the back of the free list."""
        for page_id in page_ids:
            if self._ref_counts[page_id] != 0:
                raise RuntimeError(f"free of page {page_id} with refcount {self._ref_counts[page_id]}")
            if self._kinds[page_id] is None:
                raise RuntimeError(f"free of page {page_id} that is already free")
            if page_id in self._evictable_page_ids:
                raise RuntimeError(f"free of page {page_id} that belongs to an evictable entry")
            self._kinds[page_id] = None
            self._is_free[page_id] = True
            self._free_page_ids.append(page_id)

    def release(self, page_ids: Iterable[int]) -> None:
        """Drop one reference from each page and free those no longer referenced."""
        self.free(self.decref(page_ids))

    # ---- the LRU of idle contents -------------------------------------------------
    def add_evictable(self, key: Hashable, page_ids: list[int], kind: PageKind, on_evict: Callable[[], None]) -> None:
        """Keep unreferenced pages as reusable content; the newest entry is evicted last."""
        if kind not in EVICTABLE_KINDS:
            raise ValueError(f"{kind!r} is not an evictable page kind; those are {[k.value for k in EVICTABLE_KINDS]}")
        if key in self._evictable:
            raise RuntimeError(f"evictable entry {key!r} already exists")
        for page_id in page_ids:
            if self._ref_counts[page_id] != 0:
                raise RuntimeError(f"page {page_id} is still referenced and cannot be made evictable")
            if self._kinds[page_id] is None or page_id in self._evictable_page_ids:
                raise RuntimeError(f"page {page_id} is free or already evictable")
        self._evictable[key] = EvictableEntry(list(page_ids), kind, on_evict)
        self._evictable_page_ids.update(page_ids)
        self._num_evictable_pages += len(page_ids)

    def take_evictable(self, key: Hashable) -> list[int] | None:
        """Reuse an idle entry: its pages get refcount 1 again. None if it was evicted."""
        entry = self._evictable.pop(key, None)
        if entry is None:
            return None
        self._num_evictable_pages -= len(entry.page_ids)
        self._evictable_page_ids.difference_update(entry.page_ids)
        for page_id in entry.page_ids:
            self._ref_counts[page_id] = 1
        return entry.page_ids

    def contains_evictable(self, key: Hashable) -> bool:
        return key in self._evictable

    def evictable_keys(self, kind: PageKind | None = None) -> list[Hashable]:
        """Keys (of entries of ``kind``, or all) from least to most recently made idle (eviction order)."""
        return [key for key, entry in self._evictable.items() if kind is None or entry.kind == kind]

    def evict_oldest(self) -> None:
        if not self._evictable:
            raise OutOfPagesError("no evictable pages left")
        self.evict(next(iter(self._evictable)))

    def evict(self, key: Hashable) -> None:
        """Reclaim one idle entry now: forget its content and free its pages."""
        entry = self._evictable.pop(key)
        self._num_evictable_pages -= len(entry.page_ids)
        self.num_evictions[entry.kind] = self.num_evictions.get(entry.kind, 0) + 1
        logger.debug("evicting %s entry %r (%d pages)", entry.kind, key, len(entry.page_ids))
        self._evictable_page_ids.difference_update(entry.page_ids)
        entry.on_evict()
        self.free(entry.page_ids)
