"""Prefix caching keyed by adapter content, cache salts, and copy-on-write samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from adapter_factory import make_peft_adapter

from loraserve import LLM, SamplingParams

BLOCK = 16
PROMPT = "You are a helpful assistant. Answer briefly and precisely. " * 6 + "What is the capital of Italy?"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture()
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), block_size=BLOCK, num_pages=256)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prefix-adapters")
    return {
        name: make_peft_adapter(tiny_hf_model, root / name, rank=8, target_modules=["q_proj", "v_proj"], seed=seed)
        for seed, name in enumerate(["a", "b", "a-new"])
    }


def _expected_cached(llm: LLM, prompt: str) -> int:
    num_tokens = len(llm.tokenizer.encode(prompt))
    return (num_tokens - 1) // BLOCK * BLOCK


def _run(llm: LLM, adapter: str | None, prompt: str = PROMPT, params: SamplingParams = GREEDY) -> Any:
    return llm.generate([prompt], params, adapters=adapter, use_tqdm=False)[0]


def test_same_adapter_hits_other_adapter_and_base_miss(llm: LLM, adapter_dirs: dict[str, Path]) -> None:
    llm.add_adapter("a", adapter_dirs["a"])
    llm.add_adapter("b", adapter_dirs["b"])
    first = _run(llm, "a")
    assert first.num_cached_tokens == 0
    second = _run(llm, "a")
    assert second.num_cached_tokens == _expected_cached(llm, PROMPT) > 0
    assert second.token_ids == first.token_ids
    assert _run(llm, "b").num_cached_tokens == 0
    base = _run(llm, None)
    assert base.num_cached_tokens == 0
    assert _run(llm, None).num_cached_tokens == _expected_cached(llm, PROMPT)
    assert base.token_ids != first.token_ids  # the adapter changes the output


def test_reregistered_name_never_hits_old_blocks(llm: LLM, adapter_dirs: dict[str, Path], tiny_model_dir: Path) -> None:
    llm.add_adapter("a", adapter_dirs["a"])
    old = _run(llm, "a")
    assert _run(llm, "a").num_cached_tokens > 0
    llm.remove_adapter("a")
    llm.add_adapter("a", adapter_dirs["a-new"])
    new = _run(llm, "a")
    assert new.num_cached_tokens == 0
    fresh = LLM(str(tiny_model_dir), block_size=BLOCK, num_pages=256, enable_prefix_caching=False)
    fresh.add_adapter("a", adapter_dirs["a-new"])
    assert new.token_ids == _run(fresh, "a").token_ids
    assert new.token_ids != old.token_ids


def test_cache_salt_isolates(llm: LLM) -> None:
    engine = llm.engine
    for request_id, salt in [("1", "tenant-a"), ("2", "tenant-a"), ("3", "tenant-b"), ("4", None)]:
        engine.add_request(request_id, PROMPT, GREEDY, cache_salt=salt)
        outputs = []
        while engine.has_unfinished_requests():
            outputs.extend(o for o in engine.step() if o.finished)
        expected = _expected_cached(llm, PROMPT) if request_id == "2" else 0
        assert outputs[0].num_cached_tokens == expected, request_id


def test_prefix_cache_pages_are_evictable_and_counted(llm: LLM) -> None:
    _run(llm, None)
    pool = llm.engine.pool
    num_cached_pages = _expected_cached(llm, PROMPT) // BLOCK
    counts = pool.num_pages_by_kind()
    assert counts["prefix_cache"] >= num_cached_pages
    assert pool.num_free_pages + pool.num_evictable_pages == pool.num_pages
    cache = llm.engine.kv_manager.prefix_cache
    assert cache is not None and cache.hit_rate == 0.0
    _run(llm, None)
    assert cache.hit_rate > 0.4


def test_parallel_samples_share_prompt_pages_copy_on_write(llm: LLM) -> None:
    engine = llm.engine
    num_prompt_tokens = len(llm.tokenizer.encode(PROMPT))
    assert num_prompt_tokens % BLOCK != 0
    params = SamplingParams(n=4, temperature=0.9, seed=1234, max_tokens=6, ignore_eos=True)
    engine.add_request("fork", PROMPT, params)
    request = engine.requests["fork"]
    peak_distinct = 0
    result = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            result = output
        live = [s for s in request.seqs if s.block_ids]
        distinct = {p for s in live for p in s.block_ids}
        peak_distinct = max(peak_distinct, len(distinct))
        if len(live) == 4:  # prompt pages once: full blocks shared, the partial one copied per sample
            full_blocks = num_prompt_tokens // BLOCK
            assert len({p for s in live for p in s.block_ids[:full_blocks]}) == full_blocks
    assert result is not None and result.finished
    num_blocks_each = -(-(num_prompt_tokens + params.max_tokens) // BLOCK)
    assert peak_distinct < 4 * num_blocks_each
    separate = [
        _run(llm, None, params=SamplingParams(temperature=0.9, seed=1234 + i, max_tokens=6, ignore_eos=True))
        for i in range(4)
    ]
    assert [o.token_ids for o in result.outputs] == [o.token_ids for o in separate]
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1  # samples differ
    assert engine.pool.num_free_pages + engine.pool.num_evictable_pages == engine.pool.num_pages


def test_reset_prefix_cache_frees_cached_pages_and_refuses_while_running(llm: LLM) -> None:
    engine = llm.engine
    first = _run(llm, None)
    pool = engine.pool
    num_cached_pages = _expected_cached(llm, PROMPT) // BLOCK
    assert pool.num_pages_by_kind()["prefix_cache"] >= num_cached_pages > 0
    engine.add_request("running", PROMPT, GREEDY)
    engine.step()  # its prompt now holds KV pages
    cache = engine.kv_manager.prefix_cache
    assert cache is not None
    num_hashes = len(cache)
    assert not llm.reset_prefix_cache()
    assert len(cache) == num_hashes > 0
    llm.engine.abort_request("running")
    assert llm.reset_prefix_cache()
    assert pool.num_pages_by_kind().get("prefix_cache", 0) == 0
    assert pool.num_free_pages == pool.num_pages
    assert len(cache) == 0
    again = _run(llm, None)
    assert again.num_cached_tokens == 0
    assert again.token_ids == first.token_ids


def test_cached_tokens_report_the_first_admission_not_a_recompute(tiny_model_dir: Path) -> None:
    """A request preempted by recompute finds its own blocks (generated tokens too) cached when it
    comes back; what it reports as cached is still its prompt's hit when first admitted, and the
    cache's query and hit counters hold only first admissions (vLLM's)."""
    llm = LLM(str(tiny_model_dir), kernels="torch", block_size=4, num_pages=12, watermark=0.0)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine.add_request("a", [11, 12, 13, 14, 15], params)
    engine.add_request("b", [21, 22, 23, 24, 25], params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    assert engine.scheduler.num_preemptions > 0
    assert {rid: out.num_cached_tokens for rid, out in finished.items()} == {"a": 0, "b": 0}
    cache = engine.kv_manager.prefix_cache
    assert cache is not None
    assert (cache.num_queried_tokens, cache.num_hit_tokens) == (10, 0)  # two 5-token prompts, once each
    engine.close()
