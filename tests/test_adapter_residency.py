"""Adapter residency in the unified pool (CPU, tiny Llama): page counts, weights read from pages,
LRU eviction for KV, pinning, the host tier, and adapter-aware scheduling. Exact page ids throughout."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from adapter_factory import PROJECTIONS, make_peft_model, make_tiny_llama
from fake_runner import step as fake_step
from fake_runner import summary
from loraserve.adapters import AdapterRegistry, BaseModelShapes, LocalDirStore

from loraserve.kv_cache_manager import KVCacheManager
from loraserve.lora.layout import LORA_GROUPS, AdapterLayout
from loraserve.lora.residency import AdapterManager
from loraserve.lora.weights import group_weights, write_adapter_load
from loraserve.page_pool import OutOfPagesError, PageKind, PagePool
from loraserve.sampling_params import SamplingParams
from loraserve.scheduler import Scheduler
from loraserve.sequence import FinishReason, Sequence, SequenceStatus

BLOCK_SIZE = 4
PAGE_ELEMS = 2 * BLOCK_SIZE * 2 * 16  # one KV block of the tiny model: K and V, 2 kv heads of dim 16
QV = ("q_proj", "v_proj")
# Per rank unit and layer: in + out of each module (hidden 64, q/o 64, k/v 32, intermediate 128).
ELEMS_PER_RANK = dict(zip(PROJECTIONS, (128, 96, 96, 128, 192, 192, 192), strict=True))


@pytest.fixture(scope="module")
def base() -> Any:
    return make_tiny_llama()


class CountingRegistry(AdapterRegistry):
    """Counts parses of stored files (host-tier misses)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.loads: list[str] = []

    def parse(self, name: str, files: Any) -> Any:
        self.loads.append(name)
        return super().parse(name, files)


class Env:
    """A registry over a temporary directory, a pool, its storage and the manager over them."""

    def __init__(self, root: Path, base: Any, num_pages: int, host_cache_bytes: int = 1 << 30) -> None:
        self.root, self.base = root, base
        shapes = BaseModelShapes.from_hf_config(base.config)
        self.registry = CountingRegistry(LocalDirStore(root / "store"), shapes)
        self.pool = PagePool(num_pages)
        self.storage = torch.zeros(base.config.num_hidden_layers, num_pages, PAGE_ELEMS)
        self.manager = AdapterManager(
            self.registry, self.pool, base.config.num_hidden_layers, PAGE_ELEMS, host_cache_bytes
        )
        self.peft: dict[str, Any] = {}

    def add(self, name: str, rank: int, targets: tuple[str, ...] = PROJECTIONS, **kwargs: Any) -> str:
        """Register a random PEFT adapter and resolve it (into the host tier); return its digest."""
        self.peft[name] = make_peft_model(
            self.base, rank=rank, target_modules=list(targets), seed=len(self.peft), **kwargs
        )
        self.peft[name].save_pretrained(self.root / name, safe_serialization=True)
        self.manager.register_from_path(name, str(self.root / name))
        return self.manager.resolve(name)

    def check_weights(self, name: str, adapter_id: str) -> None:
        """Every group's stacked A, B^T and scale read from the pages equal PEFT's tensors (after
        writing the loads the manager handed out, as the runner does)."""
        for load in self.manager.take_loads():
            write_adapter_load(self.storage, load)
        layers = self.peft[name].base_model.model.model.layers
        for layer in range(len(layers)):
            views = group_weights(self.storage, self.manager.pages(adapter_id), layer)
            for group, modules in LORA_GROUPS.items():
                peft_modules = [_module(layers[layer], m) for m in modules]
                adapted = [m for m in peft_modules if m is not None]
                if not adapted:
                    assert group not in views
                    continue
                a, outputs = views[group]
                torch.testing.assert_close(a, torch.cat([m.lora_A["default"].weight for m in adapted]), rtol=0, atol=0)
                column = 0
                for peft_module, out in zip(peft_modules, outputs, strict=True):
                    assert (peft_module is None) == (out is None)
                    if peft_module is None or out is None:
                        continue
                    b = peft_module.lora_B["default"].weight
                    assert (out.column, out.rank) == (column, b.shape[1])
                    assert out.scale == pytest.approx(peft_module.scaling["default"], rel=1e-12)
                    torch.testing.assert_close(out.b_t, b.T, rtol=0, atol=0)
                    column += out.rank


def _module(layer: Any, name: str) -> Any:
    module = getattr(layer.self_attn if name[0] in "qkvo" else layer.mlp, name)
    return module if hasattr(module, "lora_A") else None


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


def test_host_tier_trims_lru_but_keeps_adapters_with_live_sequences(tmp_path: Path, base: Any) -> None:
    env = Env(tmp_path, base, num_pages=8)
    manager = env.manager
    ids = {name: env.add(name, 1, QV) for name in "abcd"}
    host = lambda: [name for name in "abcd" if ids[name] in manager._host]  # noqa: E731
    for name in "abcd":
        manager.add_live_seq(ids[name])
    manager.host_cache_bytes = 2 * manager._host[ids["a"]].num_bytes  # room for two
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
    assert sched.num_unfinished == 0 and env.manager._num_live_seqs == {}
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
    assert env.manager._num_live_seqs == {a: 3} and list(sched.waiting) == [first]
    assert step(sched) == [("r", 5)]  # the prompt; its token forks the others, first in line
    assert list(sched.waiting) == forks and all(f.block_ids[:1] == first.block_ids[:1] for f in forks)
    run_to_completion(env, sched)
    assert [s.finish_reason for s in (first, *forks)] == [FinishReason.LENGTH] * 3
    assert [s.num_output_tokens for s in (first, *forks)] == [2, 2, 2]
    second, *others = (Sequence("q", [1, 2, 3], SamplingParams(n=3, max_tokens=2), i, "a", a) for i in range(3))
    sched.add(second, forks=others)
    sched.finish(second, FinishReason.ABORT)  # before its first token: the others end with it
    assert [s.finish_reason for s in (second, *others)] == [FinishReason.ABORT] * 3
    assert sched.num_unfinished == 0 and env.manager._num_live_seqs == {}


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
    assert [(s.request_id, "not registered" in error or "not found" in error) for s, error in batch.aborted] == [
        ("g", True)
    ]
    assert gone.finish_reason is FinishReason.ABORT and sched.num_unfinished == 0
