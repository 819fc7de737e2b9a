"""The two ablation options: a fixed adapter region (``adapter_region="fixed"``) and KV reserved
at admission (``kv_allocation="reserve"``). Each must give the same tokens as the defaults and
change what it says it changes: where adapter pages come from, when KV pages are taken."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loraserve import LLM, SamplingParams
from loraserve.config import ConfigError, EngineConfig
from loraserve.kv_cache_manager import cdiv
from loraserve.page_pool import PageKind, PagePool
from tests.adapter_factory import make_peft_adapter

PROMPTS = ["The weather today", "Once upon a time there", "A list of colors:", "In the beginning", "Numbers: 1, 2"]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ablations")
    return {
        "r2": make_peft_adapter(tiny_hf_model, root / "r2", rank=2, target_modules=["q_proj", "v_proj"], seed=1),
        "r8": make_peft_adapter(tiny_hf_model, root / "r8", rank=8, target_modules=["down_proj"], seed=2),
        "r4": make_peft_adapter(tiny_hf_model, root / "r4", rank=4, target_modules=["o_proj", "up_proj"], seed=3),
    }


def run(llm: LLM, adapter_dirs: dict[str, Path], watch: Any = None) -> list[list[int]]:
    """Every prompt on each adapter in turn, all queued at once; ``watch(engine)`` after each step."""
    names = list(adapter_dirs)
    engine = llm.engine
    for name, path in adapter_dirs.items():
        llm.add_adapter(name, path)
        engine.adapters.resolver.resolve(name)  # in host memory first: runs differ by policy, not by read timing
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS * 2):
        engine.add_request(str(i), prompt, params, names[i % len(names)])
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if watch is not None:
            watch(engine)
    return [done[str(i)] for i in range(len(PROMPTS) * 2)]


def test_a_pool_over_part_of_the_page_ids() -> None:
    pool = PagePool(3, range(5, 8))
    assert pool.allocate(2) == [5, 6] and pool.num_available_pages == 1
    assert pool.num_pages_by_kind()[PageKind.KV] == 2 and pool.num_pages_by_kind()[PageKind.FREE] == 1
    with pytest.raises(ValueError):
        PagePool(3, range(0, 4))


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="max_loras"):
        EngineConfig(max_loras=4)  # without the fixed region it would do nothing
    with pytest.raises(ConfigError, match="max_loras"):
        EngineConfig(adapter_region="fixed")
    with pytest.raises(ConfigError, match="adapter_region"):
        EngineConfig(adapter_region="separate", max_loras=2)
    with pytest.raises(ConfigError, match="kv_allocation"):
        EngineConfig(kv_allocation="contiguous")


def test_fixed_region_holds_at_most_max_loras_adapters_and_keeps_kv_out(
    tiny_model_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    options: dict[str, Any] = dict(kernels="torch", block_size=4, max_num_seqs=8, enable_prefix_caching=False)
    unified = run(LLM(str(tiny_model_dir), num_pages=200, **options), adapter_dirs)
    llm = LLM(str(tiny_model_dir), num_pages=200, adapter_region="fixed", max_loras=2, max_lora_rank=8, **options)
    engine = llm.engine
    slot = engine.adapters.pages_per_adapter
    assert slot is not None and slot > 0
    assert engine.adapter_pool.page_ids == range(200 - 2 * slot, 200)  # the region: the last pages
    assert engine.pool.num_pages == 200 - 2 * slot  # KV never gets them
    seen: list[int] = []

    def watch(engine: Any) -> None:
        seen.append(len(engine.adapters.resident))
        snap = engine.stats()
        running = engine.scheduler.running
        assert snap.adapter_region_pages == 2 * slot
        assert snap.num_kv_tokens == sum(s.num_computed_tokens for s in running)
        assert snap.num_running_adapters == len({s.adapter_id for s in running}) <= 2
        kv_pages = {p for r in engine.requests.values() for s in r.seqs for p in s.block_ids}
        assert not kv_pages & set(engine.adapter_pool.page_ids)
        for resident in engine.adapters.resident.values():
            assert set(resident.page_ids) <= set(engine.adapter_pool.page_ids) and len(resident.page_ids) == slot

    fixed = run(llm, adapter_dirs, watch)
    assert fixed == unified  # the same tokens
    assert max(seen) == 2  # three adapters wanted, two slots
    loads = engine.stats().num_adapter_loads
    assert loads >= 3  # each adapter at least once; more depends on when the background loads land
    # One request at a time on each adapter in turn: two slots hold two of the three, so the third
    # must evict one and be loaded again, whatever the timing of the run above.
    for name in adapter_dirs:
        out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False, adapters=name)
        assert len(out[0].outputs[0].token_ids) == 2
        watch(engine)
    assert engine.stats().num_adapter_loads > loads  # so an adapter was evicted and loaded again
    stats = engine.stats()
    assert stats.num_pages == 200 and sum(stats.pages_by_kind.values()) == 200


def test_fixed_region_must_leave_room_for_kv(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="fixed adapter region"):
        LLM(str(tiny_model_dir), kernels="torch", num_pages=20, adapter_region="fixed", max_loras=64)


def test_reserved_kv_is_taken_at_admission(tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    options: dict[str, Any] = dict(kernels="torch", block_size=4, max_num_seqs=8, enable_prefix_caching=False)
    paged_running: list[int] = []
    paged = run(
        LLM(str(tiny_model_dir), num_pages=40, **options),
        adapter_dirs,
        lambda engine: paged_running.append(len(engine.scheduler.running)),
    )
    reserve_running: list[int] = []

    def watch(engine: Any) -> None:
        reserve_running.append(len(engine.scheduler.running))
        for seq in engine.scheduler.running:  # every page of its prompt + max_tokens, from its first step
            assert len(seq.block_ids) == cdiv(seq.num_prompt_tokens + seq.params.max_tokens - 1, 4)

    reserved = run(LLM(str(tiny_model_dir), num_pages=40, kv_allocation="reserve", **options), adapter_dirs, watch)
    assert reserved == paged
    assert max(reserve_running) < max(paged_running)  # the same pool runs fewer requests at once
