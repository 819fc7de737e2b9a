"""PagePool accounting: exact page ids, free-list order, refcounts and the evictable LRU."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from loraserve.page_pool import OutOfPagesError, PageKind, PagePool


def recorder(events: list[str], key: str) -> Callable[[], None]:
    return lambda: events.append(key)


def make_idle(
    pool: PagePool, key: str, page_ids: list[int], events: list[str], kind: PageKind = PageKind.PREFIX_CACHE
) -> None:
    """Drop the only reference of ``page_ids`` and keep them as an evictable entry."""
    assert pool.decref(page_ids) == page_ids
    pool.add_evictable(key, page_ids, kind, recorder(events, key))


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="num_pages must be positive"):
        PagePool(0)


def test_fresh_pool_allocates_lowest_first() -> None:
    pool = PagePool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.allocate(0) == []
    assert pool.num_free_pages == 3
    assert [pool.ref_count(p) for p in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]


def test_freed_pages_are_reused_after_never_used_ones() -> None:
    pool = PagePool(6)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.release([2, 1])  # the free list is now [4, 5, 2, 1]
    assert pool.allocate(3) == [4, 5, 2]
    pool.release([0])  # [1, 0]
    assert pool.allocate(2) == [1, 0]
    assert pool.num_free_pages == 0


def test_refcounts_incref_decref_release() -> None:
    pool = PagePool(4)
    pages = pool.allocate(2)
    assert pages == [0, 1]
    pool.incref([0])
    pool.incref([0])
    assert pool.ref_count(0) == 3
    assert pool.decref([0, 1]) == [1]  # only page 1 dropped to zero
    assert pool.ref_count(0) == 2
    assert pool.ref_count(1) == 0
    pool.free([1])
    pool.release([0])
    assert pool.num_free_pages == 3  # page 0 still has one reference
    pool.release([0])
    assert pool.num_free_pages == 4
    assert pool.allocate(4) == [2, 3, 1, 0]


def test_refcount_errors() -> None:
    pool = PagePool(4)
    with pytest.raises(RuntimeError, match="decref of page 2 that is not allocated"):
        pool.decref([2])
    with pytest.raises(RuntimeError, match="incref of page 3 that is not allocated"):
        pool.incref([3])
    [page] = pool.allocate(1)
    with pytest.raises(RuntimeError, match="free of page 0 with refcount 1"):
        pool.free([page])
    pool.release([page])
    with pytest.raises(RuntimeError, match="not allocated"):
        pool.release([page])  # double release
    assert pool.num_free_pages == 4


def test_double_free_raises_and_keeps_free_list_unique() -> None:
    pool = PagePool(4)
    [page] = pool.allocate(1)
    pool.release([page])
    with pytest.raises(RuntimeError):
        pool.free([page])  # already on the free list
    with pytest.raises(RuntimeError):
        pool.free([3])  # never allocated
    assert pool.num_free_pages == 4
    # A duplicated free-list entry would hand the same page to two owners.
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3]


def test_allocate_beyond_available_raises_without_taking_pages() -> None:
    pool = PagePool(4)
    pool.allocate(3)
    with pytest.raises(OutOfPagesError, match=r"need 2 pages, only 1 free or evictable of 4"):
        pool.allocate(2)
    assert pool.num_free_pages == 1
    assert not pool.can_allocate(2)
    assert pool.can_allocate(1)
    assert not pool.can_allocate(1, reserve=1)


def test_evictable_entries_are_evicted_oldest_first_only_when_short() -> None:
    pool = PagePool(6)
    events: list[str] = []
    make_idle(pool, "a", pool.allocate(2), events)  # pages 0, 1
    make_idle(pool, "b", pool.allocate(2), events)  # pages 2, 3
    make_idle(pool, "c", pool.allocate(1), events)  # page 4
    assert pool.evictable_keys() == ["a", "b", "c"]
    assert (pool.num_free_pages, pool.num_evictable_pages, pool.num_available_pages) == (1, 5, 6)

    assert pool.allocate(1) == [5]  # a free page: nothing evicted
    assert events == []
    assert pool.allocate(1) == [0]  # evicts "a" only; page 1 stays free
    assert events == ["a"]
    assert pool.num_free_pages == 1
    assert pool.allocate(3) == [1, 2, 3]  # evicts "b"
    assert events == ["a", "b"]
    assert pool.evictable_keys() == ["c"]
    assert pool.contains_evictable("c") and not pool.contains_evictable("a")
    assert pool.num_evictions == {"prefix_cache": 2, "adapter_idle": 0}
    with pytest.raises(OutOfPagesError, match="need 2 pages, only 1 free or evictable"):
        pool.allocate(2)
    assert events == ["a", "b"]
    pool.evict_oldest()
    assert events == ["a", "b", "c"]
    with pytest.raises(OutOfPagesError, match="no evictable pages left"):
        pool.evict_oldest()


def test_evict_by_key_frees_that_entry_only() -> None:
    pool = PagePool(4)
    events: list[str] = []
    make_idle(pool, "x", pool.allocate(2), events)  # pages 0, 1
    make_idle(pool, "y", pool.allocate(1), events, kind=PageKind.ADAPTER_IDLE)  # page 2
    assert pool.evictable_keys(PageKind.ADAPTER_IDLE) == ["y"]
    assert pool.evictable_keys(PageKind.PREFIX_CACHE) == ["x"]
    pool.evict("y")
    assert events == ["y"]
    assert pool.evictable_keys() == ["x"]
    assert (pool.num_free_pages, pool.num_evictable_pages) == (2, 2)
    assert pool.allocate(2) == [3, 2]  # the free list first: "x" stays
    assert pool.num_evictions == {"prefix_cache": 0, "adapter_idle": 1}
    with pytest.raises(KeyError):
        pool.evict("y")


def test_take_evictable_revives_entry() -> None:
    pool = PagePool(4)
    events: list[str] = []
    make_idle(pool, "x", pool.allocate(2), events)  # pages 0, 1
    make_idle(pool, "y", pool.allocate(1), events)  # page 2
    assert pool.take_evictable("x") == [0, 1]
    assert [pool.ref_count(p) for p in (0, 1, 2)] == [1, 1, 0]
    assert pool.evictable_keys() == ["y"]
    assert pool.num_evictable_pages == 1
    assert pool.take_evictable("x") is None
    assert pool.allocate(2) == [3, 2]  # pressure evicts "y", not the revived "x"
    assert events == ["y"]
    assert pool.take_evictable("y") is None
    pool.release([0, 1])
    assert pool.num_free_pages == 2


def test_add_evictable_errors() -> None:
    with pytest.raises(ValueError, match="not an evictable page kind"):
        PagePool(2).add_evictable("k", [], PageKind.KV, lambda: None)
    pool = PagePool(4)
    events: list[str] = []
    pages = pool.allocate(2)
    with pytest.raises(RuntimeError, match="page 0 is still referenced"):
        pool.add_evictable("k", pages, PageKind.PREFIX_CACHE, recorder(events, "k"))
    make_idle(pool, "k", pages, events)
    with pytest.raises(RuntimeError, match="already exists"):
        pool.add_evictable("k", [], PageKind.PREFIX_CACHE, recorder(events, "k"))


def test_num_pages_by_kind() -> None:
    pool = PagePool(10)
    events: list[str] = []
    assert pool.allocate(3, PageKind.KV) == [0, 1, 2]
    assert pool.allocate(2, PageKind.ADAPTER) == [3, 4]
    make_idle(pool, "idle-adapter", pool.allocate(1, PageKind.ADAPTER), events, kind=PageKind.ADAPTER_IDLE)
    make_idle(pool, "prefix", pool.allocate(2, PageKind.KV), events, kind=PageKind.PREFIX_CACHE)
    counts = {"free": 2, "kv": 3, "adapter": 2, "prefix_cache": 2, "adapter_idle": 1}
    assert pool.num_pages_by_kind() == counts and set(counts) == {kind.value for kind in PageKind}
    assert pool.num_available_pages == 5
    assert pool.take_evictable("prefix") == [6, 7]
    assert pool.num_pages_by_kind() == {"free": 2, "kv": 5, "adapter": 2, "prefix_cache": 0, "adapter_idle": 1}


def test_allocate_contiguous_on_fresh_pool() -> None:
    pool = PagePool(8)
    assert pool.allocate_contiguous(0) == []
    assert pool.allocate_contiguous(4) == [0, 1, 2, 3]
    assert pool.num_pages_by_kind()["adapter"] == 4
    assert pool.allocate(1) == [4]


def test_allocate_contiguous_finds_run_and_returns_none_when_fragmented() -> None:
    pool = PagePool(10)
    events: list[str] = []
    pool.allocate(10)
    pool.release([8, 5, 1, 4, 2, 6])  # the free list, unsorted: [8, 5, 1, 4, 2, 6]
    assert pool.allocate_contiguous(3) == [4, 5, 6]
    assert pool.allocate(3) == [8, 1, 2]  # the others kept their free-list order
    pool.release([9, 7, 3])
    assert pool.allocate_contiguous(2) is None  # 9, 7, 3: no two consecutive
    assert pool.num_free_pages == 3
    make_idle(pool, "e", [0], events)
    assert pool.allocate_contiguous(2) is None  # never evicts
    assert events == []
    assert pool.allocate_contiguous(1) == [3]
    assert pool.allocate_contiguous(4) is None


def _first_run_reference(free: list[int], num_pages: int) -> list[int] | None:
    """The lowest run of ``num_pages`` consecutive free ids, by a plain scan of the sorted list."""
    ordered = sorted(free)
    run_start = 0
    for index in range(1, len(ordered) + 1):
        if index < len(ordered) and ordered[index] != ordered[index - 1] + 1:
            if index - run_start >= num_pages:
                break
            run_start = index
    else:
        if len(ordered) - run_start < num_pages:
            return None
    return ordered[run_start : run_start + num_pages]


@pytest.mark.parametrize("seed", range(6))
def test_allocate_contiguous_takes_the_lowest_run_that_fits_and_keeps_the_free_order(seed: int) -> None:
    rng = random.Random(seed)
    pool = PagePool(300)
    pool.allocate(300)
    freed = rng.sample(range(300), rng.randrange(0, 300))  # the free list in this (random) order
    pool.release(freed)
    free = list(freed)
    for num_pages in (rng.randrange(1, 12) for _ in range(20)):
        expected = _first_run_reference(free, num_pages)
        assert pool.allocate_contiguous(num_pages) == expected
        if expected is not None:
            free = [p for p in free if p not in expected]
        assert pool.allocate(0) == [] and pool.num_free_pages == len(free)
    assert pool.allocate(len(free)) == free  # the pages left, in their free-list order


@pytest.mark.parametrize("seed", range(6))
def test_free_list_order_survives_runs_taken_and_freed_again(seed: int) -> None:
    """Mixed allocations, runs and releases against a plain list: runs leave stale entries in the
    free list (skipped later, compacted in bulk), so a page freed again after a run took it must
    come back once, at the back, and never twice."""
    rng = random.Random(seed)
    pool = PagePool(200)
    free = list(range(200))  # the reference free list
    held: list[int] = []
    compactions: list[int] = []
    compact = pool._compact_free_list
    pool._compact_free_list = lambda: (compactions.append(pool.num_free_pages), compact())[1]  # type: ignore[method-assign]
    for _ in range(400):
        op = rng.random()
        if op < 0.35:
            num_pages = rng.randrange(1, 10)
            expected = _first_run_reference(free, num_pages)
            assert pool.allocate_contiguous(num_pages) == expected
            if expected is not None:
                free = [p for p in free if p not in expected]
                held += expected
        elif op < 0.6 and free:
            num_pages = rng.randrange(1, min(len(free), 8) + 1)
            assert pool.allocate(num_pages) == free[:num_pages]
            held += free[:num_pages]
            free = free[num_pages:]
        elif held:
            released = rng.sample(held, rng.randrange(1, len(held) + 1))
            pool.release(released)
            held = [p for p in held if p not in released]
            free += released
        assert pool.num_free_pages == len(free) and pool.num_available_pages == len(free)
    assert compactions  # the bulk removal of stale entries ran too
    assert pool.allocate(len(free)) == free
    assert pool.allocate_contiguous(1) is None and pool.num_free_pages == 0
