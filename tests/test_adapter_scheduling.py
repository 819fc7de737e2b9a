"""Adapter-aware scheduling over the unified pool (CPU, tiny Llama): many adapters admitted in one step,
FCFS admission while a pinned adapter and KV do not fit, adapter loads and pages carried in the batch, and
update_from_output as the one owner of a sequence's end. Exact page ids throughout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fake_runner import step as fake_step
from fake_runner import summary
from residency_env import BLOCK_SIZE, QV, Env, base_fixture  # noqa: F401 (pytest fixture: base)

from loraserve.kv_cache_manager import KVCacheManager
from loraserve.lora.weights import write_adapter_load
from loraserve.sampling_params import SamplingParams
from loraserve.scheduler import Scheduler
from loraserve.sequence import FinishReason, Sequence, SequenceStatus


def make_scheduler(env: Env) -> Scheduler:
    return Scheduler(
        KVCacheManager(env.pool, BLOCK_SIZE), max_num_seqs=16, max_num_batched_tokens=64, adapters=env.manager
    )


def make_seq(env: Env, request_id: str, adapter_id: str | None, num_prompt_tokens: int, max_tokens: int) -> Sequence:
    """A request as the engine makes it: its adapter resolved (the scheduler counts it as live)."""
    params = SamplingParams(max_tokens=max_tokens)
    return Sequence(request_id, list(range(num_prompt_tokens)), params, adapter_id=adapter_id)


def step(sched: Scheduler) -> list[tuple[str, int]]:
    """One engine step with the fake runner; returns (request, tokens) scheduled."""
    return summary(fake_step(sched))


def run_to_completion(env: Env, sched: Scheduler) -> None:
    for _ in range(100):
        if not sched.num_unfinished:
            break
        assert step(sched)
    assert sched.num_unfinished == 0 and env.manager.host.live_seqs == {}
    assert env.pool.num_free_pages + env.pool.num_evictable_pages == env.pool.num_pages
    assert all(r.num_pins == 0 for r in env.manager.resident.values())


def test_many_adapters_admitted_in_one_step_and_nothing_leaks(tmp_path: Path, base: Any) -> None:
    env = Env(tmp_path, base, num_pages=64)
    ids = [env.add(f"a{i}", 1, QV) for i in range(12)]
    sched = make_scheduler(env)
    seqs = [make_seq(env, f"s{i}", adapter_id, 3, 3) for i, adapter_id in enumerate(ids)]
    seqs.append(make_seq(env, "base", None, 3, 3))
    for seq in seqs:
        sched.add(seq)
    assert step(sched) == [(seq.request_id, 3) for seq in seqs]  # 12 adapters and the base model, no cap
    for i, adapter_id in enumerate(ids):  # each admission pins its adapter's page, then takes a KV block
        assert env.manager.resident[adapter_id].page_ids == [2 * i] and seqs[i].block_ids == [2 * i + 1]
        assert env.manager.resident[adapter_id].num_pins == 1
    run_to_completion(env, sched)
    assert env.pool.evictable_keys() == [("adapter", adapter_id) for adapter_id in ids]


def test_fcfs_admission_waits_while_pinned_adapter_and_kv_do_not_fit(tmp_path: Path, base: Any) -> None:
    env = Env(tmp_path, base, num_pages=19)
    a, b, c = env.add("a", 2), env.add("b", 2), env.add("c", 1, QV)  # 8, 8 and 1 pages
    sched = make_scheduler(env)
    x, y, z = make_seq(env, "x", a, 8, 2), make_seq(env, "y", b, 8, 1), make_seq(env, "z", c, 1, 1)
    for seq in (x, y, z):
        sched.add(seq)
    assert step(sched) == [("x", 8)]  # y needs 8 adapter + 2 KV pages; a and x's KV leave 9
    assert env.manager.resident[a].page_ids == list(range(8)) and x.block_ids == [8, 9]
    assert list(sched.waiting) == [y, z]  # z would fit but does not overtake y
    # Adapter and KV pages are checked together: y's failed admission loaded (and evicted) nothing.
    assert env.manager.num_loads == 1 and b not in env.manager.resident and env.pool.num_free_pages == 9
    assert step(sched) == [("x", 1)]  # a still pinned: y waits
    assert list(sched.waiting) == [y, z]
    assert step(sched) == [("y", 8), ("z", 1)]  # x finished: a is idle and gets evicted for z's KV
    assert env.manager.resident[b].page_ids == list(range(8, 16)) and env.manager.resident[c].page_ids == [18]
    assert a not in env.manager.resident and env.manager.num_evictions == 1
    run_to_completion(env, sched)
    assert env.manager.num_loads == 3


def test_the_batch_carries_adapter_loads_and_pages_and_the_manager_writes_nothing(tmp_path: Path, base: Any) -> None:
    env = Env(tmp_path, base, num_pages=24)
    a, b = env.add("a", 2), env.add("b", 1, QV)  # 8 pages and 1 page
    sched = make_scheduler(env)
    x, y, z = make_seq(env, "x", a, 4, 2), make_seq(env, "y", a, 4, 2), make_seq(env, "z", b, 4, 2)
    for seq in (x, y, z):
        sched.add(seq)
    batch = sched.schedule()
    # One load per adapter newly placed, in admission order, with its exact pages; y reuses a's.
    assert [(load.pages.adapter_id, load.pages.page_ids) for load in batch.adapter_loads] == [
        (a, tuple(range(8))),
        (b, (10,)),
    ]
    assert x.block_ids == [8] and y.block_ids == [9] and z.block_ids == [11]
    assert {k: v.page_ids for k, v in batch.adapters.items()} == {a: tuple(range(8)), b: (10,)}
    assert all(batch.adapters[load.pages.adapter_id] is load.pages for load in batch.adapter_loads)
    assert env.storage.abs().sum() == 0  # the runner writes the loads, not the scheduler
    for load in batch.adapter_loads:
        write_adapter_load(env.storage, load)
    assert env.storage[:, [*range(8), 10]].abs().sum() > 0 and env.storage[:, [8, 9, 11]].abs().sum() == 0
    sched.update_from_output(batch, [None, None, None])
    second = sched.schedule()  # nothing new to load; the pages still travel with the batch
    assert second.adapter_loads == [] and {k: v.page_ids for k, v in second.adapters.items()} == {
        a: tuple(range(8)),
        b: (10,),
    }


def test_update_from_output_forks_samples_and_is_the_one_owner_of_their_end(tmp_path: Path, base: Any) -> None:
    """n = 3 on an adapter: the scheduler counts three live sequences at admission, forks the two
    others once the first's prompt is computed, and ends them all; aborting before the first
    token also ends the samples not forked yet. Nothing stays counted or pinned."""
    env = Env(tmp_path, base, num_pages=32)
    a = env.add("a", 1, QV)
    sched = make_scheduler(env)
    first, *forks = (Sequence("r", [1, 2, 3, 4, 5], SamplingParams(n=3, max_tokens=2), i, "a", a) for i in range(3))
    sched.add(first, forks=forks)
    assert env.manager.host.live_seqs == {a: 3} and list(sched.waiting) == [first]
    assert step(sched) == [("r", 5)]  # the prompt; its token forks the others, first in line
    assert list(sched.waiting) == forks and all(f.block_ids[:1] == first.block_ids[:1] for f in forks)
    run_to_completion(env, sched)
    assert [s.finish_reason for s in (first, *forks)] == [FinishReason.LENGTH] * 3
    assert [s.num_output_tokens for s in (first, *forks)] == [2, 2, 2]
    second, *others = (Sequence("q", [1, 2, 3], SamplingParams(n=3, max_tokens=2), i, "a", a) for i in range(3))
    sched.add(second, forks=others)
    sched.finish(second, FinishReason.ABORT)  # before its first token: the others end with it
    assert [s.finish_reason for s in (second, *others)] == [FinishReason.ABORT] * 3
    assert sched.num_unfinished == 0 and env.manager.host.live_seqs == {}


def test_a_request_waits_for_its_adapter_inside_the_scheduler(tmp_path: Path, base: Any) -> None:
    env = Env(tmp_path, base, num_pages=32)
    a = env.add("a", 1, QV)
    sched = make_scheduler(env)
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=1), adapter_name="a")  # not resolved yet
    sched.add(seq)
    assert seq.status is SequenceStatus.WAITING_FOR_ADAPTER and sched.num_waiting == 1 and not sched.waiting
    assert step(sched) == [("r", 3)]  # the adapter is in host memory: resolved, admitted, run
    assert seq.adapter_id == a and not sched.loading
    gone = Sequence("g", [1, 2, 3], SamplingParams(max_tokens=1), adapter_name="missing")
    sched.add(gone)
    batch = sched.schedule()
    assert [(s.request_id, "not registered" in error or "not found" in error) for s, error, _ in batch.aborted] == [
        ("g", True)
    ]
    assert gone.finish_reason is FinishReason.ABORT and sched.num_unfinished == 0
