"""Scheduler driven by hand (no model): exact batches, page ids, preemption and no leaks."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from fake_runner import step, summary

from loraserve.kv_cache_manager import KVCacheManager, cdiv
from loraserve.page_pool import PagePool
from loraserve.sampling_params import SamplingParams
from loraserve.scheduler import Scheduler
from loraserve.sequence import FinishReason, Sequence, SequenceStatus

BLOCK_SIZE = 4


def make_scheduler(
    num_pages: int,
    max_num_seqs: int = 8,
    budget: int = 64,
    watermark: int = 0,
    mode: str = "recompute",
    num_host_pages: int = 0,
) -> Scheduler:
    host = PagePool(num_host_pages) if num_host_pages else None
    manager = KVCacheManager(PagePool(num_pages), BLOCK_SIZE, watermark, host)
    return Scheduler(manager, max_num_seqs, budget, preemption_mode=mode)


def make_seq(request_id: str, num_prompt_tokens: int, max_tokens: int) -> Sequence:
    return Sequence(request_id, list(range(num_prompt_tokens)), SamplingParams(max_tokens=max_tokens))


def run_to_completion(sched: Scheduler, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not sched.num_unfinished:
            return
        assert not step(sched).is_empty
    raise AssertionError("the scheduler did not finish every request")


def test_fcfs_admission_and_max_num_seqs() -> None:
    sched = make_scheduler(64, max_num_seqs=2)
    a, b, c, d = make_seq("a", 3, 2), make_seq("b", 3, 2), make_seq("c", 3, 1), make_seq("d", 2, 1)
    for seq in (a, b, c, d):
        sched.add(seq)
    assert summary(step(sched)) == [("a", 3), ("b", 3)]
    assert list(sched.waiting) == [c, d]
    assert (a.block_ids, b.block_ids) == ([0], [1])
    assert summary(step(sched)) == [("a", 1), ("b", 1)]
    assert a.finish_reason is FinishReason.LENGTH and a.output_token_ids == [1000, 1001]
    assert summary(step(sched)) == [("c", 3), ("d", 2)]
    assert (c.block_ids, d.block_ids) == ([], [])  # finished and freed
    assert sched.num_unfinished == 0
    last = sched.schedule()  # nothing to run, but the finished rows to release reach the runner once
    assert not last.is_empty and not last.seqs and sorted(last.released_seq_ids) == sorted([c.seq_id, d.seq_id])
    assert sched.schedule().is_empty
    assert sched.kv_manager.pool.num_free_pages == 64


def test_token_budget_chunked_prefill_and_mixed_batches() -> None:
    sched = make_scheduler(64, budget=8)
    a, b = make_seq("a", 20, 3), make_seq("b", 6, 2)
    sched.add(a)
    sched.add(b)
    batch = step(sched)
    assert summary(batch) == [("a", 8)] and not batch.samples(0)
    assert a.block_ids == [0, 1]
    assert summary(step(sched)) == [("a", 8)]
    assert a.block_ids == [0, 1, 2, 3]
    assert summary(step(sched)) == [("a", 4), ("b", 4)]  # last chunk of a, first chunk of b
    assert (a.block_ids, b.block_ids) == ([0, 1, 2, 3, 4], [5])
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 0)
    assert summary(step(sched)) == [("a", 1), ("b", 2)]  # decode + prefill in one step
    assert (a.block_ids, b.block_ids) == ([0, 1, 2, 3, 4, 6], [5, 7])
    assert summary(step(sched)) == [("a", 1), ("b", 1)]
    assert a.is_finished and b.is_finished
    assert sched.kv_manager.pool.num_free_pages == 64


def test_watermark_blocks_admission_without_overtaking() -> None:
    sched = make_scheduler(8, watermark=2)
    a, b, c = make_seq("a", 16, 2), make_seq("b", 12, 1), make_seq("c", 4, 1)
    for seq in (a, b, c):
        sched.add(seq)
    assert summary(step(sched)) == [("a", 16)]  # b needs 3 + 2 > 4 pages; c may not overtake
    assert list(sched.waiting) == [b, c]
    assert summary(step(sched)) == [("a", 1)]
    assert summary(step(sched)) == [("b", 12), ("c", 4)]
    assert (b.block_ids, c.block_ids) == ([], [])
    assert sched.kv_manager.pool.num_free_pages == 8


def test_recompute_preemption_of_the_latest_admitted() -> None:
    sched = make_scheduler(5)
    pool = sched.kv_manager.pool
    a, b, c = make_seq("a", 8, 7), make_seq("b", 8, 6), make_seq("c", 16, 4)
    for seq in (a, b, c):
        sched.add(seq)
    assert summary(step(sched)) == [("a", 8), ("b", 8)]
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])

    batch = step(sched)  # a takes the last page; b cannot grow and is preempted
    assert summary(batch) == [("a", 1)]
    assert a.block_ids == [0, 1, 4]
    assert list(sched.waiting) == [b, c]  # b at the front
    assert b.status is SequenceStatus.WAITING
    assert (b.num_computed_tokens, b.block_ids, b.num_output_tokens) == (0, [], 1)
    assert (b.num_preemptions, sched.num_preemptions) == (1, 1)
    assert pool.num_free_pages == 2

    for _ in range(3):
        assert summary(step(sched)) == [("a", 1)]
    assert summary(step(sched)) == [("a", 1)]
    assert a.block_ids == [0, 1, 4, 3]  # the survivor reused b's freed page 3
    assert summary(step(sched)) == [("a", 1)]
    assert a.is_finished

    assert summary(step(sched)) == [("b", 9)]  # recompute prompt + its first output
    assert b.block_ids == [2, 3, 4]
    run_to_completion(sched)
    assert b.output_token_ids == [1000, 1001, 1002, 1003, 1004, 1005]
    assert c.num_output_tokens == 4
    assert pool.num_free_pages == 5


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make_scheduler(4, budget=5)
    a, b = make_seq("a", 5, 10), make_seq("b", 4, 10)
    sched.add(a)
    sched.add(b)
    assert summary(step(sched)) == [("a", 5)]
    assert summary(step(sched)) == [("a", 1), ("b", 4)]
    assert summary(step(sched)) == [("a", 1), ("b", 1)]
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    assert summary(step(sched)) == [("a", 1), ("b", 1)]
    batch = step(sched)
    assert summary(batch) == [("a", 1)]  # b preempted; its first chunk would fit but waits
    assert a.block_ids == [0, 1, 3]
    assert list(sched.waiting) == [b]
    assert summary(step(sched)) == [("a", 1), ("b", 4)]
    assert b.block_ids == [2]
    run_to_completion(sched)
    assert sched.kv_manager.pool.num_free_pages == 4


def test_swap_preemption_keeps_computed_tokens() -> None:
    sched = make_scheduler(5, mode="swap", num_host_pages=4)
    pool, host = sched.kv_manager.pool, sched.kv_manager.host_pool
    assert host is not None
    a, b = make_seq("a", 8, 7), make_seq("b", 8, 6)
    sched.add(a)
    sched.add(b)
    assert summary(step(sched)) == [("a", 8), ("b", 8)]
    batch = step(sched)
    assert summary(batch) == [("a", 1)]
    assert batch.swap_out == [(2, 0), (3, 1)] and batch.swap_in == []
    assert list(sched.swapped) == [b] and b.status is SequenceStatus.SWAPPED
    assert (b.block_ids, b.num_computed_tokens) == ([0, 1], 8)
    assert host.num_free_pages == 2
    for _ in range(4):  # b needs 3 pages to come back; only 2 are free
        batch = step(sched)
        assert summary(batch) == [("a", 1)] and batch.swap_in == []
    assert a.block_ids == [0, 1, 4, 2]
    assert summary(step(sched)) == [("a", 1)]
    assert a.is_finished

    batch = step(sched)
    assert summary(batch) == [("b", 1)]  # no recomputation
    assert batch.swap_in == [(0, 3), (1, 2)]
    assert b.block_ids == [3, 2, 4]
    assert host.num_free_pages == 4
    run_to_completion(sched)
    assert b.num_output_tokens == 6 and b.num_preemptions == 1
    assert (pool.num_free_pages, host.num_free_pages) == (5, 4)


def test_swap_falls_back_to_recompute_when_host_is_full() -> None:
    sched = make_scheduler(5, mode="swap", num_host_pages=1)
    a, b = make_seq("a", 8, 2), make_seq("b", 8, 2)
    sched.add(a)
    sched.add(b)
    step(sched)
    batch = step(sched)
    assert batch.swap_out == []
    assert list(sched.waiting) == [b] and b.num_computed_tokens == 0
    run_to_completion(sched)
    assert sched.kv_manager.pool.num_free_pages == 5


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int, n: int) -> list[Sequence]:
    """The ``n`` samples of one request; the first is queued, the others fork off it."""
    params = SamplingParams(n=n, max_tokens=max_tokens)
    return [Sequence(request_id, list(range(num_prompt_tokens)), params, sample_index=i) for i in range(n)]


def test_waiting_forks_give_their_pages_back_when_nothing_else_can_run() -> None:
    """Forked samples wait holding their prompt's pages. When the one running sequence has to
    preempt itself (or the head of the line does not fit) with nothing running, those pages are
    all that could make room: the forks free them and recompute their prompt. Before, the step
    after came back empty with requests waiting (no progress, ever)."""
    sched = make_scheduler(5, mode="swap", num_host_pages=8)
    pool = sched.kv_manager.pool
    a0, a1 = make_request("a", 7, 6, n=2)
    b0, b1 = make_request("b", 7, 6, n=2)
    sched.add(a0, forks=[a1])
    sched.add(b0, forks=[b1])
    assert summary(step(sched)) == [("a", 7), ("b", 7)]
    assert list(sched.waiting) == [b1, a1] and (a1.block_ids, b1.block_ids) == ([0, 1], [2, 3])  # shared
    batch = step(sched)  # a0 copies its shared last block; b0 swaps out (its pages stay: b1 holds them)
    assert summary(batch) == [("a", 1)] and batch.copy_pages == [(1, 4)] and batch.swap_out == [(2, 0), (3, 1)]
    assert pool.num_free_pages == 0
    assert sched.num_preemptions == 1
    batch = step(sched)  # a0 swaps itself out: nothing runs, so the forks give their pages back
    assert summary(batch) == [] and batch.swap_out == [(0, 2), (4, 3)]
    # a0's swap and the two forks' recomputations
    assert (sched.num_preemptions, a0.num_preemptions, a1.num_preemptions, b1.num_preemptions) == (4, 1, 1, 1)
    assert list(sched.waiting) == [b1, a1] and (a1.block_ids, b1.block_ids, a1.num_computed_tokens) == ([], [], 0)
    assert pool.num_free_pages == 5
    batch = step(sched)
    assert summary(batch) == [("b", 1), ("a", 1)] and (b0.block_ids, a0.block_ids) == ([4, 3], [2, 1, 0])
    run_to_completion(sched)
    for seq in (a0, a1, b0, b1):
        assert seq.finish_reason is FinishReason.LENGTH and seq.num_output_tokens == 6 and seq.block_ids == []
    assert pool.num_free_pages == 5


def test_finish_frees_pages_wherever_the_sequence_is() -> None:
    sched = make_scheduler(5, max_num_seqs=2, mode="swap", num_host_pages=4)
    pool, host = sched.kv_manager.pool, sched.kv_manager.host_pool
    assert host is not None
    a, b, c = make_seq("a", 8, 9), make_seq("b", 8, 9), make_seq("c", 2, 9)
    for seq in (a, b, c):
        sched.add(seq)
    step(sched)
    step(sched)  # b swapped out, c waiting
    assert (list(sched.swapped), list(sched.waiting)) == ([b], [c])
    sched.finish(b, FinishReason.ABORT)
    assert (b.status, b.finish_reason, b.block_ids) == (SequenceStatus.FINISHED, FinishReason.ABORT, [])
    assert host.num_free_pages == 4 and not sched.swapped
    sched.finish(c, FinishReason.ABORT)
    assert not sched.waiting
    sched.finish(a, FinishReason.ABORT)
    assert not sched.running and a.block_ids == []
    sched.finish(a, FinishReason.LENGTH)  # no-op once finished
    assert a.finish_reason is FinishReason.ABORT
    assert (sched.num_unfinished, pool.num_free_pages) == (0, 5)


def test_abort_mid_prefill_frees_its_pages() -> None:
    sched = make_scheduler(8, budget=8)
    a, b = make_seq("a", 20, 4), make_seq("b", 4, 1)
    sched.add(a)
    sched.add(b)
    assert summary(step(sched)) == [("a", 8)]
    sched.finish(a, FinishReason.ABORT)
    assert summary(step(sched)) == [("b", 4)]
    assert sched.kv_manager.pool.allocate(8) == [3, 4, 5, 6, 7, 1, 0, 2]


def check_invariants(sched: Scheduler) -> None:
    """Every page's reference count is the number of block tables holding it (forked samples share
    their prompt's pages, copy-on-write); only forks wait holding pages: their prompt's."""
    pool, host = sched.kv_manager.pool, sched.kv_manager.host_pool
    assert len(sched.running) <= sched.max_num_seqs
    device_seqs = [*sched.running, *sched.waiting]
    for pages_pool, seqs in ((pool, device_seqs), (host, list(sched.swapped))):
        if pages_pool is None:
            assert not seqs
            continue
        refs = Counter(p for seq in seqs for p in seq.block_ids)
        assert all(pages_pool.ref_count(p) == refs.get(p, 0) for p in range(pages_pool.num_pages))
        assert pages_pool.num_free_pages + len(refs) == pages_pool.num_pages
        for seq in seqs:
            assert len(seq.block_ids) == len(set(seq.block_ids)), "a page twice in one block table"
    for seq in [*sched.running, *sched.swapped]:
        assert seq.status is not SequenceStatus.WAITING
        assert len(seq.block_ids) == cdiv(seq.num_computed_tokens, BLOCK_SIZE)
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING
        if seq.block_ids:  # a fork: its parent's prompt pages, the last prompt token to compute
            assert seq.sample_index > 0 and seq.num_computed_tokens == seq.num_prompt_tokens - 1
            assert len(seq.block_ids) == cdiv(seq.num_prompt_tokens, BLOCK_SIZE)


@pytest.mark.parametrize("max_n", [1, 3], ids=["n1", "n1-3"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_randomized_stress_keeps_invariants_and_frees_everything(mode: str, seed: int, max_n: int) -> None:
    """Requests of 1 to ``max_n`` samples arrive, run and are aborted at random in a small pool;
    every step makes progress (forks holding pages neither deadlock nor livelock the pool)."""
    rng = random.Random(seed)
    sched = make_scheduler(12, max_num_seqs=4, budget=16, watermark=1, mode=mode, num_host_pages=6)
    pending = [make_request(f"r{i}", rng.randint(1, 20), rng.randint(1, 12), rng.randint(1, max_n)) for i in range(40)]
    all_seqs, aborted, num_swap_outs = [seq for samples in pending for seq in samples], set(), 0
    for _ in range(3000):
        if pending and rng.random() < 0.4:
            first, *forks = pending.pop(0)
            sched.add(first, forks=forks)
        if not pending and not sched.num_unfinished:
            break
        unfinished = [*sched.running, *sched.waiting, *sched.swapped]
        if unfinished and rng.random() < 0.02:
            victim = rng.choice(unfinished)
            sched.finish(victim, FinishReason.ABORT)
            aborted.add(victim.request_id)
        had_work = sched.num_unfinished > 0
        batch = step(sched)
        assert batch.num_tokens <= sched.max_num_batched_tokens
        num_swap_outs += bool(batch.swap_out)
        assert not (had_work and batch.is_empty), "no progress although requests are unfinished"
        check_invariants(sched)
    assert not pending and not sched.num_unfinished
    assert sched.kv_manager.pool.num_free_pages == 12
    assert sched.kv_manager.host_pool is not None and sched.kv_manager.host_pool.num_free_pages == 6
    assert sched.num_preemptions > 0 and (num_swap_outs > 0) == (mode == "swap")
    for seq in all_seqs:
        assert seq.is_finished and seq.block_ids == []
        if seq.request_id not in aborted:
            assert seq.finish_reason is FinishReason.LENGTH
            assert seq.num_output_tokens == seq.params.max_tokens
