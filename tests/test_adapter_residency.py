"""Adapter residency in the unified pool (CPU, tiny Llama): page counts, weights read from pages,
LRU eviction for KV, pinning and the host tier (scheduling: ``test_adapter_scheduling.py``). Exact page
ids throughout."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from adapter_factory import PROJECTIONS
from residency_env import BLOCK_SIZE, ELEMS_PER_RANK, PAGE_ELEMS, QV, Env, base_fixture  # noqa: F401 (pytest fixture: base)

from loraserve.kv_cache_manager import KVCacheManager
from loraserve.lora.layout import AdapterLayout
from loraserve.lora.weights import write_adapter_load
from loraserve.page_pool import OutOfPagesError, PageKind
from loraserve.sampling_params import SamplingParams
from loraserve.sequence import Sequence


def expected_pages(rank: int, targets: tuple[str, ...]) -> int:
    return math.ceil(rank * sum(ELEMS_PER_RANK[m] for m in targets) / PAGE_ELEMS)


@pytest.mark.parametrize("targets", [QV, PROJECTIONS], ids=["qv", "all"])
def test_pages_grow_linearly_with_rank_without_padding(tmp_path: Path, base: Any, targets: tuple[str, ...]) -> None:
    env = Env(tmp_path, base, num_pages=400)
    first_page = 0
    for rank in (1, 2, 3, 5, 8, 16, 33):
        adapter_id = env.add(f"r{rank}", rank, targets)
        layout: AdapterLayout = env.manager.layout(adapter_id)
        per_layer = rank * sum(ELEMS_PER_RANK[m] for m in targets)
        assert layout.layer_elems == (per_layer, per_layer)  # no padding to a maximum rank
        num_pages = expected_pages(rank, targets)
        assert env.manager.num_pages(adapter_id) == num_pages
        free_before = env.pool.num_free_pages
        assert env.manager.acquire(adapter_id)
        assert env.pool.num_free_pages == free_before - num_pages
        assert env.manager.resident[adapter_id].page_ids == list(range(first_page, first_page + num_pages))
        first_page += num_pages
    assert env.pool.num_pages_by_kind()["adapter"] == first_page


def test_weights_from_contiguous_and_fragmented_pages(tmp_path: Path, base: Any) -> None:
    env = Env(tmp_path, base, num_pages=40)
    contiguous = env.add("contiguous", 2, rank_pattern={"k_proj": 3, "model.layers.1.mlp.down_proj": 1})
    num_pages = env.manager.num_pages(contiguous)
    # k's B^T of rank 3 and v's of rank 2 (rows of 32) end at 160 past a multiple of 64: B_o^T
    # (rows of 64) starts 32 elements later, at a multiple of 64 (lora/layout.py: WEIGHT_ALIGN)
    assert env.manager.layout(contiguous).layer_elems == (2144 + 32, 1952 + 32) and num_pages == 9
    assert env.manager.acquire(contiguous)
    assert env.manager.resident[contiguous].page_ids == list(range(9))
    env.check_weights("contiguous", contiguous)
    kv = env.pool.allocate(31)  # KV on pages 9..39, then every other one freed: no two free pages touch
    env.storage[:, kv] = -7.0
    env.pool.release(kv[1::2])
    fragmented = env.add("fragmented", 1, ("q_proj", "v_proj", "down_proj"), alpha=5, use_rslora=True)
    assert env.manager.num_pages(fragmented) == 2
    assert env.manager.acquire(fragmented)
    resident = env.manager.resident[fragmented]
    assert resident.page_ids == [10, 12] and not resident.is_contiguous
    env.check_weights("fragmented", fragmented)
    env.check_weights("contiguous", contiguous)
    assert bool((env.storage[:, kv[::2]] == -7.0).all())  # KV pages untouched by the adapter writes


def test_idle_adapters_reclaimed_for_kv_in_lru_order_then_reloaded(tmp_path: Path, base: Any) -> None:
    env = Env(tmp_path, base, num_pages=40)
    manager, pool = env.manager, env.pool
    a, b, c = env.add("a", 2), env.add("b", 1), env.add("c", 1)
    for adapter_id in (a, b, c):
        assert manager.acquire(adapter_id)
    assert [manager.resident[x].page_ids for x in (a, b, c)] == [list(range(8)), [8, 9, 10, 11], [12, 13, 14, 15]]
    manager.release(b)
    cached = pool.allocate(2)  # a cached prefix block pair [16, 17]: idle content in the same LRU
    evicted_prefix: list[int] = []
    pool.add_evictable("prefix", pool.decref(cached), PageKind.PREFIX_CACHE, lambda: evicted_prefix.append(1))
    manager.release(a)
    manager.release(c)
    assert pool.evictable_keys() == [("adapter", b), "prefix", ("adapter", a), ("adapter", c)]
    assert pool.num_free_pages == 22 and pool.num_available_pages == 40
    kv = KVCacheManager(pool, BLOCK_SIZE)
    seq = Sequence("s", [1] * 22 * BLOCK_SIZE, SamplingParams())

    def grow(num_blocks: int) -> list[int]:
        before = len(seq.block_ids)
        seq.token_ids += [1] * num_blocks * BLOCK_SIZE
        assert kv.allocate_slots(seq, seq.num_uncomputed_tokens) == []  # no copies
        seq.num_computed_tokens = seq.num_tokens
        return seq.block_ids[before:]

    seq.token_ids.clear()
    assert grow(22) == list(range(18, 40)) and manager.num_evictions == 0  # free pages first
    assert grow(1) == [8] and b not in manager.resident and {a, c} <= set(manager.resident)
    assert grow(4) == [9, 10, 11, 16] and evicted_prefix == [1] and a in manager.resident
    assert grow(2) == [17, 0] and a not in manager.resident and c in manager.resident
    assert manager.num_evictions == 2 and pool.num_evictions == {"adapter_idle": 2, "prefix_cache": 1}
    assert manager.num_loads == 3 and manager.acquire(b)  # reloaded from the host tier into free pages 1..4
    assert manager.num_loads == 4 and manager.resident[b].page_ids == [1, 2, 3, 4]
    env.check_weights("b", b)


def test_pinned_adapter_is_never_evicted(tmp_path: Path, base: Any) -> None:
    env = Env(tmp_path, base, num_pages=12)
    a, b = env.add("a", 2), env.add("b", 1)
    assert env.manager.acquire(a)  # pages 0..7, pinned
    kv = env.pool.allocate(4)
    with pytest.raises(OutOfPagesError):
        env.pool.allocate(1, PageKind.KV)
    assert KVCacheManager(env.pool, BLOCK_SIZE).allocate_slots(Sequence("s", [1], SamplingParams()), 1) is None
    env.pool.release(kv[:2])
    assert not env.manager.acquire(b)  # needs 4 pages; 2 free and nothing evictable
    assert env.manager.num_loads == 1 and env.pool.num_free_pages == 2 and b not in env.manager.resident
    assert env.manager.resident[a].page_ids == list(range(8)) and env.manager.num_evictions == 0
    env.check_weights("a", a)


def test_reviving_an_idle_adapter_does_not_reload(tmp_path: Path, base: Any) -> None:
    env = Env(tmp_path, base, num_pages=20)
    a = env.add("a", 2)
    assert env.manager.acquire(a) and env.manager.acquire(a)  # two sequences: two pins
    env.manager.release(a)
    assert not env.pool.contains_evictable(("adapter", a))
    env.manager.release(a)
    assert env.pool.evictable_keys() == [("adapter", a)] and env.pool.num_available_pages == 20
    assert env.manager.acquire(a)
    assert env.manager.num_loads == 1 and env.manager.resident[a].page_ids == list(range(8))
    assert not env.pool.contains_evictable(("adapter", a)) and env.pool.num_free_pages == 12


def test_load_of_a_failed_step_is_written_again_or_its_pages_freed(tmp_path: Path, base: Any) -> None:
    """A step that carried a load failed (``unwritten``): the next step using the adapter (a sequence
    still pinning it, or one acquiring it meanwhile) gets the same pages written again; the last
    release of one never rewritten frees them."""
    env = Env(tmp_path, base, num_pages=40)
    manager, pool = env.manager, env.pool
    a = env.add("a", 2)
    assert manager.acquire(a)
    (load,) = manager.take_loads()
    manager.unwritten([load])
    assert manager.acquire(a) and manager.take_loads() == []  # a second sequence while the first pins it
    assert manager.pages_for_step(a) == load.pages
    (again,) = manager.take_loads()
    assert again.pages == load.pages and manager.num_loads == 2
    assert manager.pages_for_step(a) == load.pages and manager.take_loads() == []  # written once
    env.storage.zero_()
    write_adapter_load(env.storage, again)
    env.check_weights("a", a)
    manager.release(a)
    manager.release(a)  # written: kept as idle content
    assert pool.num_pages_by_kind()[PageKind.ADAPTER_IDLE] == 8 and a in manager.resident
    assert manager.acquire(a) and manager.take_loads() == []  # revived without a copy
    manager.unwritten([again])
    manager.release(a)
    assert pool.num_free_pages == 40 and a not in manager.resident
    assert manager.acquire(a) and manager.resident[a].page_ids == list(range(8))  # loaded afresh
    assert len(manager.take_loads()) == 1 and manager.num_loads == 3


def test_host_tier_trims_lru_but_keeps_adapters_with_live_sequences(tmp_path: Path, base: Any) -> None:
    env = Env(tmp_path, base, num_pages=8)
    manager = env.manager
    ids = {name: env.add(name, 1, QV) for name in "abcd"}
    host = lambda: [name for name in "abcd" if ids[name] in manager.host]  # noqa: E731
    for name in "abcd":
        manager.add_live_seq(ids[name])
    manager.host.capacity_bytes = manager.host.num_bytes // 2  # room for two of the four (equal sizes)
    manager.add_live_seq(ids["a"])
    manager.drop_live_seq(ids["a"])
    assert host() == list("abcd")  # over budget, but every adapter has a live sequence
    manager.drop_live_seq(ids["c"])
    assert host() == ["a", "b", "d"]
    manager.drop_live_seq(ids["a"])
    assert host() == ["b", "d"]
    manager.drop_live_seq(ids["b"])
    manager.drop_live_seq(ids["d"])
    assert host() == ["b", "d"] and env.registry.loads == list("abcd")
    assert [manager.resolve(n) for n in "bd"] == [ids["b"], ids["d"]] and env.registry.loads == list("abcd")
    assert manager.resolve("a") == ids["a"] and env.registry.loads == [*"abcd", "a"]
    manager.add_live_seq(ids["a"])
    assert host() == ["a", "d"]  # b was the least recently used of the idle ones
    assert manager.acquire(ids["a"])
    env.check_weights("a", ids["a"])


def test_resident_adapter_trimmed_from_host_can_be_reloaded_after_eviction(tmp_path: Path, base: Any) -> None:
    """A request resolved onto a resident adapter that left the host tier must survive its eviction."""
    env = Env(tmp_path, base, num_pages=8, host_cache_bytes=0)
    a = env.add("a", 1, QV)
    env.manager.add_live_seq(a)
    assert env.manager.acquire(a)
    env.manager.release(a)
    env.manager.drop_live_seq(a)  # the host copy goes (budget 0); the pages stay as an idle cache
    assert env.manager.resolve("a") == a  # a new request for "a" arrives ...
    env.manager.add_live_seq(a)
    env.pool.release(env.pool.allocate(8))  # ... and KV pressure evicts the idle pages before it runs
    assert a not in env.manager.resident
    assert env.manager.acquire(a)  # needs the host copy: resolve must not trust residency alone
    env.check_weights("a", a)
