"""KVCacheManager: block tables grown one block at a time, watermark, free and swapping."""

from __future__ import annotations

from fake_runner import step

from loraserve.kv_cache_manager import KVCacheManager, ReservingKVCacheManager, cdiv, tokens_at_most
from loraserve.page_pool import PagePool
from loraserve.prefix_cache import PrefixCacheIndex
from loraserve.sampling_params import SamplingParams
from loraserve.scheduler import Scheduler
from loraserve.sequence import Sequence


def make_seq(num_prompt_tokens: int) -> Sequence:
    return Sequence("req", list(range(num_prompt_tokens)), SamplingParams())


def run_step(manager: KVCacheManager, seq: Sequence, num_new_tokens: int) -> None:
    """Allocate for ``num_new_tokens``, compute them, and sample a token if the step reaches the end."""
    assert manager.allocate_slots(seq, num_new_tokens) == []
    seq.num_computed_tokens += num_new_tokens
    if seq.num_computed_tokens == seq.num_tokens:
        seq.append_token(7)


def test_cdiv() -> None:
    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_blocks_are_allocated_one_at_a_time_as_tokens_arrive() -> None:
    pool = PagePool(8)
    manager = KVCacheManager(pool, block_size=4)
    a, b = make_seq(5), make_seq(3)
    assert manager.num_pages_needed(a, 5) == 2
    run_step(manager, a, 5)  # prefill of 5 tokens: 2 blocks
    assert a.block_ids == [0, 1]
    run_step(manager, b, 3)
    assert b.block_ids == [2]
    expected_blocks = {6: [0, 1], 7: [0, 1], 8: [0, 1], 9: [0, 1, 3]}
    for num_tokens_after_step, blocks in expected_blocks.items():
        run_step(manager, a, 1)  # decode: the 9th token needs a 3rd block
        assert a.num_computed_tokens == num_tokens_after_step
        assert a.block_ids == blocks
    run_step(manager, b, 1)
    run_step(manager, b, 1)
    assert b.block_ids == [2, 4]  # b's 5th token crossed its block boundary
    assert pool.num_free_pages == 3


def test_chunked_prefill_allocates_only_what_each_chunk_needs() -> None:
    manager = KVCacheManager(PagePool(8), block_size=4)
    seq = make_seq(10)
    run_step(manager, seq, 3)
    assert seq.block_ids == [0]
    assert manager.num_pages_needed(seq, 1) == 0
    run_step(manager, seq, 6)
    assert seq.block_ids == [0, 1, 2]
    run_step(manager, seq, 1)
    assert seq.block_ids == [0, 1, 2]
    assert seq.num_tokens == 11


def test_allocate_slots_is_all_or_nothing() -> None:
    pool = PagePool(3)
    manager = KVCacheManager(pool, block_size=4)
    seq = make_seq(16)
    assert manager.allocate_slots(seq, 16) is None
    assert seq.block_ids == []
    assert pool.num_free_pages == 3
    assert manager.allocate_slots(seq, 12) == []
    assert seq.block_ids == [0, 1, 2]


def test_watermark_blocks_admission_but_not_growth() -> None:
    pool = PagePool(8)
    manager = KVCacheManager(pool, block_size=4, num_watermark_pages=2)
    a, big, small = make_seq(20), make_seq(12), make_seq(4)
    assert manager.can_admit(a, 20)  # 5 + 2 <= 8
    run_step(manager, a, 20)
    assert a.block_ids == [0, 1, 2, 3, 4]
    assert not manager.can_admit(big, 12)  # 3 + 2 > 3 free
    assert manager.can_admit(small, 4)  # 1 + 2 <= 3 free
    assert manager.can_admit(big, 4)  # a first chunk of one block fits
    for _ in range(8):  # a running sequence grows into the watermark
        run_step(manager, a, 1)
    assert a.block_ids == [0, 1, 2, 3, 4, 5, 6]
    assert pool.num_free_pages == 1
    assert not manager.can_admit(small, 4)
    assert manager.allocate_slots(small, 4) == []  # allocation itself ignores the watermark


def test_free_returns_pages_in_reverse_block_order() -> None:
    pool = PagePool(8)
    manager = KVCacheManager(pool, block_size=4)
    a, b = make_seq(12), make_seq(4)
    run_step(manager, a, 12)
    run_step(manager, b, 4)
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [3])
    manager.free(a)
    assert a.block_ids == []
    assert pool.num_free_pages == 7
    assert pool.allocate(5) == [4, 5, 6, 7, 2]  # freed pages go behind the never-used ones


def test_free_keeps_shared_blocks_for_their_other_owner() -> None:
    pool = PagePool(4)
    manager = KVCacheManager(pool, block_size=4)
    seq = make_seq(8)
    run_step(manager, seq, 8)
    pool.incref([0])  # another owner of the first block
    manager.free(seq)
    assert pool.ref_count(0) == 1
    assert pool.num_free_pages == 3
    pool.release([0])
    assert pool.num_free_pages == 4


def test_decode_into_a_shared_partial_block_copies_it_and_an_owned_one_does_not() -> None:
    """A forked sample shares its parent's partly filled last block: the first of them to write a
    token there gets a copy (copy-on-write), the other then writes in place."""
    pool = PagePool(8)
    manager = KVCacheManager(pool, block_size=4)
    parent = make_seq(5)
    run_step(manager, parent, 5)  # blocks [0, 1]; block 1 holds one token
    child = Sequence("req", list(range(5)), SamplingParams())
    child.num_computed_tokens = parent.num_computed_tokens
    manager.fork(parent, child)
    child.append_token(8)
    assert child.block_ids == [0, 1] and pool.ref_count(1) == 2
    assert manager.allocate_slots(child, 1) == [(1, 2)]  # the shared partial block is copied
    assert child.block_ids == [0, 2] and pool.ref_count(1) == 1
    assert manager.allocate_slots(parent, 1) == []  # now the parent's alone: written in place
    assert parent.block_ids == [0, 1]
    assert pool.ref_count(0) == 2  # the full first block stays shared


def test_swap_out_and_in_exact_mappings_and_host_accounting() -> None:
    pool, host = PagePool(8), PagePool(4)
    manager = KVCacheManager(pool, block_size=4, host_pool=host)
    assert host.allocate(1) == [0]  # someone else holds host page 0
    a, b = make_seq(9), make_seq(4)
    run_step(manager, a, 9)
    run_step(manager, b, 4)
    assert (a.block_ids, b.block_ids) == ([0, 1, 2], [3])

    assert manager.can_swap_out(a)
    assert manager.swap_out(a) == [(0, 1), (1, 2), (2, 3)]
    assert a.block_ids == [1, 2, 3]  # now host pages
    assert a.num_computed_tokens == 9
    assert host.num_free_pages == 0
    assert pool.num_free_pages == 7
    assert not manager.can_swap_out(b)  # the host pool is full

    c = make_seq(8)
    run_step(manager, c, 8)
    assert c.block_ids == [4, 5]  # free list was [4, 5, 6, 7, 0, 1, 2]
    assert manager.can_swap_in(a)
    assert manager.swap_in(a) == [(1, 6), (2, 7), (3, 0)]
    assert a.block_ids == [6, 7, 0]
    assert host.num_free_pages == 3
    assert pool.num_free_pages == 2
    assert host.allocate(3) == [1, 2, 3]  # host pages freed in block order


def test_swap_in_respects_watermark_and_free_swapped() -> None:
    pool, host = PagePool(6), PagePool(4)
    manager = KVCacheManager(pool, block_size=4, num_watermark_pages=2, host_pool=host)
    a, b = make_seq(8), make_seq(12)
    run_step(manager, a, 8)
    assert manager.swap_out(a) == [(0, 0), (1, 1)]
    run_step(manager, b, 12)
    assert b.block_ids == [2, 3, 4]
    assert not manager.can_swap_in(a)  # 2 + 2 > 3 free
    manager.free(b)
    assert manager.can_swap_in(a)
    manager.free_swapped(a)
    assert a.block_ids == []
    assert host.num_free_pages == 4
    assert pool.num_free_pages == 6


def test_no_host_pool_means_no_swap() -> None:
    manager = KVCacheManager(PagePool(4), block_size=4)
    seq = make_seq(4)
    run_step(manager, seq, 4)
    assert not manager.can_swap_out(seq)


def caching_manager(num_pages: int) -> tuple[PagePool, KVCacheManager, PrefixCacheIndex]:
    """A pool of ``num_pages``, a manager over it with prefix caching on, and its cache index."""
    pool = PagePool(num_pages)
    manager = KVCacheManager(pool, block_size=4, enable_prefix_caching=True)
    assert manager.prefix_cache is not None
    return pool, manager, manager.prefix_cache


def test_full_blocks_are_registered_once_and_again_after_a_new_table() -> None:
    """``cache_full_blocks`` offers each full block once; a new block table (after a preemption
    freed the old one) is offered from its first block again."""
    pool, manager, cache = caching_manager(8)
    seq = make_seq(6)
    run_step(manager, seq, 6)
    manager.cache_full_blocks([seq])
    assert (seq.block_ids, seq.num_registered_blocks, len(cache)) == ([0, 1], 1, 1)
    assert cache.hash_of(0) is not None and cache.hash_of(1) is None
    run_step(manager, seq, 1)
    manager.cache_full_blocks([seq])  # 7 of 8 tokens computed: nothing new is full
    assert seq.num_registered_blocks == 1
    run_step(manager, seq, 1)
    manager.cache_full_blocks([seq])
    assert (seq.num_registered_blocks, cache.hash_of(1) is not None, len(cache)) == (2, True, 2)
    manager.free(seq)  # preempted (recompute): its pages become evictable cached blocks
    assert (seq.block_ids, seq.num_registered_blocks) == ([], 0)
    for page_id in (0, 1):
        cache.remove_page(page_id)  # as if evicted: the recomputed blocks must be registered anew
    pool.take_evictable(("kv", seq.block_hashes[0]))
    seq.num_computed_tokens = 0
    run_step(manager, seq, seq.num_tokens)
    manager.cache_full_blocks([seq])
    assert seq.num_registered_blocks == 2
    assert all(cache.hash_of(page_id) is not None for page_id in seq.block_ids[:2])


def test_prompt_logprobs_neither_match_nor_count_as_a_prefix_query() -> None:
    """A sequence asking for prompt logprobs computes every prompt token: matching it reuses and
    counts nothing, and undoing that (it was not admitted) leaves the counters as they were."""
    _, manager, cache = caching_manager(8)
    cached = make_seq(9)
    run_step(manager, cached, 9)
    manager.cache_full_blocks([cached])
    seq = Sequence("req", list(range(9)), SamplingParams(prompt_logprobs=1))
    for _ in range(3):  # the head of the line, not admitted three steps running
        assert manager.match_prefix(seq) == 0 and seq.block_ids == []
        manager.unmatch_prefix(seq)
    assert (cache.num_queried_tokens, cache.num_hit_tokens) == (0, 0)
    plain = make_seq(9)
    assert manager.match_prefix(plain) == 8 and plain.block_ids == cached.block_ids[:2]
    assert (cache.num_queried_tokens, cache.num_hit_tokens) == (9, 8)


def _samples(num_prompt_tokens: int, n: int, max_tokens: int) -> list[Sequence]:
    params = SamplingParams(n=n, max_tokens=max_tokens)
    return [Sequence("r", list(range(num_prompt_tokens)), params, sample_index=i) for i in range(n)]


def test_a_fork_shares_only_the_prompts_blocks_not_the_parents_reservation() -> None:
    """With KV reserved at admission, a forked sample shares its parent's prompt blocks and reserves
    the rest for itself; before, it shared the parent's reserved, never written pages, started
    without a reservation of its own and later needed pages (and a preemption) to write them."""
    pool = PagePool(6)
    sched = Scheduler(ReservingKVCacheManager(pool, 4, tokens_at_most), max_num_seqs=4, max_num_batched_tokens=64)
    first, child = _samples(5, n=2, max_tokens=9)  # 13 tokens reserved a sample: 4 pages, 8 of 6 for both
    sched.add(first, forks=[child])
    step(sched)
    assert (first.block_ids, child.block_ids, pool.num_free_pages) == ([0, 1, 2, 3], [0, 1], 2)
    copies = []
    for _ in range(40):
        if not sched.num_unfinished:
            break
        batch = step(sched)
        copies.extend(batch.copy_pages)
        if child in batch.seqs and child.num_output_tokens == 0:
            assert child.block_ids == [0, 1, 5, 3]  # admitted once its own reservation fit
    assert copies == [(1, 4)]  # the parent's first decode token, into the block both shared
    assert sched.num_preemptions == 0 and pool.num_free_pages == 6


def test_a_fork_copies_a_registered_block_before_rewriting_its_last_prompt_token() -> None:
    """A forked sample recomputes the last prompt token; when the prompt fills its last block, that
    block is registered in the prefix cache, so it is copied first even when the parent has let it
    go (before: written in place, though registered pages are never written again)."""
    manager = KVCacheManager(PagePool(16), 4, enable_prefix_caching=True)
    sched = Scheduler(manager, max_num_seqs=1, max_num_batched_tokens=64)
    first, child = _samples(8, n=2, max_tokens=1)
    sched.add(first, forks=[child])
    batch = sched.schedule()
    sched.update_from_output(batch, [100])  # the prompt computed: child forked, first ended
    assert child.block_ids == [0, 1] and [manager.pool.ref_count(p) for p in (0, 1)] == [1, 1]
    assert manager.prefix_cache is not None and manager.prefix_cache.hash_of(1) is not None
    batch = sched.schedule()
    assert batch.seqs == [child] and batch.copy_pages == [(1, 2)] and child.block_ids == [0, 2]
