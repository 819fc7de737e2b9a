"""Async scheduling (``async_scheduling=True``): each step is scheduled and launched before the
step before it has handed its tokens to the host (``launched_step.py``). On the CPU the kernels
have run by the time a launch returns, so nothing overlaps, but the engine goes through the GPU's
order of events; these tests check what that order must keep: the tokens of the engine without
it (stop strings, lengths, seeds, adapters, prefix hits, chunked prompts, preemption), nothing
computed for a sequence whose last token is on its way, aborts of requests in flight, and no
overlap while a request needs each step's tokens on the host (logprobs, penalties, n > 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from adapter_factory import make_peft_adapter

from loraserve import LLM, SamplingParams
from loraserve.launched_step import LaunchedStep
from loraserve.llm_engine import LLMEngine
from loraserve.page_pool import PageKind
from loraserve.scheduled_batch import ScheduledBatch

ENGINE = dict(kernels="torch", block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
SHARED = "the same long prefix of a prompt that several requests share, "


@pytest.fixture(scope="module")
def adapter_dirs(tiny_hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("async_scheduling")
    return {
        "a": make_peft_adapter(tiny_hf_model, root / "a", rank=4, target_modules=["q_proj", "v_proj"], seed=1),
        "b": make_peft_adapter(tiny_hf_model, root / "b", rank=8, target_modules=["down_proj"], seed=2),
    }


class LaunchLog:
    """Wraps ``runner.launch``: each launch's batch size and whether a step was in flight."""

    def __init__(self, engine: LLMEngine) -> None:
        self.tokens: list[int] = []  # tokens computed by each launch
        self.chained: list[bool] = []  # launched while the step before was in flight
        self.host_bound: list[bool] = []  # a request needing host tokens was live
        self.swaps_out = 0  # launches that swapped KV pages out
        launch = engine.runner.launch

        def logged(batch: ScheduledBatch, previous: LaunchedStep | None = None) -> LaunchedStep:
            self.tokens.append(batch.num_tokens)
            self.chained.append(previous is not None)
            self.host_bound.append(bool(engine._host_bound))
            self.swaps_out += bool(batch.swap_out)
            return launch(batch, previous)

        engine.runner.launch = logged  # type: ignore[method-assign]


def _make(model_dir: Path, adapters: dict[str, Path], async_scheduling: bool, **options: Any) -> LLM:
    llm = LLM(str(model_dir), async_scheduling=async_scheduling, **{**ENGINE, **options})
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


def _workload(stop: str | None) -> tuple[list[str], list[SamplingParams], list[str | None]]:
    prompts = [SHARED + word for word in ("one", "two", "three", "four", "five")]
    prompts += ["a short one", "A much longer prompt that the small token budget splits into chunks " * 2]
    params = [
        SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0),
        SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0),
        SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0, stop=[stop] if stop else ()),
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=7),
        SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(max_tokens=14, ignore_eos=True),  # unseeded: the engine's seeds, drawn in order
        SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.0),
    ]
    adapters: list[str | None] = [None, "a", "b", "a", None, "b", "a"]
    return prompts, params, adapters


def _generate(llm: LLM, stop: str | None) -> list[tuple[list[int], str, str | None]]:
    prompts, params, adapters = _workload(stop)
    outputs = llm.generate(prompts, params, adapters=adapters, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]


def _all_pages_back(engine: LLMEngine) -> None:
    assert engine.scheduler.num_unfinished == 0 and not engine.requests
    engine.step()  # hands the runner the rows of the last finished sequences
    assert engine.runner.input_batch.num_rows == 0
    assert engine.stats().pages_by_kind.get(PageKind.KV, 0) == 0


SWAPPING = dict(num_pages=24, preemption_mode="swap", num_swap_pages=64)


@pytest.mark.parametrize(
    "pool", [dict(num_pages=400), dict(num_pages=24), SWAPPING], ids=["roomy", "recomputing", "swapping"]
)
def test_same_tokens_as_without_overlap(
    tiny_model_dir: Path, adapter_dirs: dict[str, Path], pool: dict[str, Any]
) -> None:
    sync_llm = _make(tiny_model_dir, adapter_dirs, False, **pool)
    free_text = _generate(sync_llm, None)[2][1]
    stop = free_text[len(free_text) // 2 : len(free_text) // 2 + 3]  # met mid-output: ends request 2 early
    expected = _generate(sync_llm, stop)
    assert expected[2][2] == "stop" and len(expected[2][0]) < 16

    async_llm = _make(tiny_model_dir, adapter_dirs, True, **pool)
    log = LaunchLog(async_llm.engine)
    assert _generate(async_llm, None)[2][1] == free_text  # (also draws the unseeded request's seeds as above)
    got = _generate(async_llm, stop)
    assert got == expected
    assert sum(log.chained) > len(log.chained) // 2  # most steps launched with the one before in flight
    assert all(t >= 0 for tokens, _, _ in got for t in tokens)
    if pool["num_pages"] < 100:
        assert async_llm.engine.scheduler.num_preemptions > 0
        assert (log.swaps_out > 0) == (pool is SWAPPING)
    assert async_llm.engine.stats().prefix_cache_matched_tokens > 0
    _all_pages_back(async_llm.engine)


def test_nothing_computed_for_a_sequence_whose_last_token_is_on_its_way(tiny_model_dir: Path) -> None:
    """Every request ends by its length: the overlapped engine computes exactly the tokens the
    engine without overlap does (none for a sequence whose pending token reaches max_tokens)."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 8, 13)]
    prompts = [f"request number {i}" for i in range(len(params))]
    computed = []
    for async_scheduling in (False, True):
        llm = _make(tiny_model_dir, {}, async_scheduling, num_pages=200)
        log = LaunchLog(llm.engine)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3, 8, 13]
        computed.append(sum(log.tokens))
    assert computed[0] == computed[1]


def test_abort_while_in_flight(tiny_model_dir: Path) -> None:
    llm = _make(tiny_model_dir, {}, True, num_pages=200)
    engine = llm.engine
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), f"prompt {i} of the abort test", params)
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None and engine.requests["2"].seqs[0].num_pending_tokens == 1
    engine.abort_request("2")
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            finished[output.request_id] = output
    assert sorted(finished) == ["0", "1", "3"]
    assert all(len(o.outputs[0].token_ids) == 20 for o in finished.values())
    _all_pages_back(engine)


def test_a_request_finished_while_its_step_is_in_flight_has_a_logprob_per_token(tiny_model_dir: Path) -> None:
    """A drain's deadline (``finish_request``) between a step's launch and its collection: the
    token on its way is not delivered, and neither is the logprobs entry its launch recorded."""
    llm = _make(tiny_model_dir, {}, True, num_pages=100)
    engine = llm.engine
    engine.add_request("x", "hello there my friend", SamplingParams(max_tokens=20, logprobs=1, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None and engine.requests["x"].seqs[0].num_pending_tokens == 1
    output = engine.finish_request("x")
    assert output is not None
    (completion,) = output.outputs
    assert completion.finish_reason == "abort" and completion.logprobs is not None
    assert len(completion.token_ids) == 3 and len(completion.logprobs) == 3
    assert all(token in entry for token, entry in zip(completion.token_ids, completion.logprobs, strict=True))
    while engine.has_unfinished_requests():
        engine.step()
    _all_pages_back(engine)


def test_requests_that_need_host_tokens_turn_the_overlap_off(tiny_model_dir: Path) -> None:
    """While a request with logprobs, penalties or n > 1 runs, each step waits for the one
    before; its outputs (logprobs included) equal the engine's without async scheduling."""
    plain = SamplingParams(max_tokens=10, ignore_eos=True)
    host_bound = [
        SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=6, ignore_eos=True, repetition_penalty=1.3, temperature=0.7, seed=5),
        SamplingParams(max_tokens=6, ignore_eos=True, n=2, temperature=0.7, seed=9),
    ]
    prompts = ["first", "second", "third", "fourth"]
    results = []
    for async_scheduling in (False, True):
        llm = _make(tiny_model_dir, {}, async_scheduling, num_pages=200)
        log = LaunchLog(llm.engine)
        outputs = llm.generate(prompts, [plain, *host_bound], use_tqdm=False)
        results.append([([c.token_ids for c in o.outputs], o.outputs[0].logprobs) for o in outputs])
        if async_scheduling:
            assert not any(c and h for c, h in zip(log.chained, log.host_bound, strict=True))
            assert any(log.chained)  # the plain request's last steps, alone, overlapped
    assert results[0] == results[1]


def test_a_sequence_swapped_while_in_flight_registers_no_host_page(
    tiny_model_dir: Path, adapter_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequence swapped out while its step is in flight has that step's tokens applied after
    the swap: its ``block_ids`` are host page ids then, which must never enter the device pool's
    prefix cache (later hits would read other requests' KV or adapter pages). Same tokens as the
    engine without overlap, round after round over a warm prefix cache."""
    from loraserve.kv_cache_manager import KVCacheManager
    from loraserve.sequence import SequenceStatus

    registered_while_swapped: list[str] = []
    register = KVCacheManager._register

    def checked(self: KVCacheManager, seq: Any, num_full: int) -> None:
        if seq.status is SequenceStatus.SWAPPED:
            registered_while_swapped.append(seq.request_id)
        register(self, seq, num_full)

    monkeypatch.setattr(KVCacheManager, "_register", checked)
    prompts = [SHARED + w for w in ("one", "two", "three", "four", "five")]
    prompts += ["a short one", "A much longer prompt that the small token budget splits into chunks " * 2]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for m in (1, 2, 16, 12, 9, 14, 7)]
    adapters = [None, "a", "b", "a", None, "b", "a"]
    outputs = []
    for overlap in (False, True):
        llm = _make(tiny_model_dir, adapter_dirs, overlap, num_pages=24, preemption_mode="swap", num_swap_pages=24)
        rounds = [llm.generate(prompts, params, adapters=adapters, use_tqdm=False) for _ in range(3)]
        outputs.append([[o.outputs[0].token_ids for o in outs] for outs in rounds])
        assert llm.engine.scheduler.num_preemptions > 0
        _all_pages_back(llm.engine)
    assert not registered_while_swapped
    assert outputs[1] == outputs[0]


def test_swap_in_counts_device_pages_only(tiny_model_dir: Path) -> None:
    """More swap pages than device pages: deciding whether a swapped sequence fits back must not
    look its host page ids up in the device pool (an IndexError past the pool's last page)."""
    llm = LLM(
        str(tiny_model_dir),
        **ENGINE,
        num_pages=24,
        preemption_mode="swap",
        num_swap_pages=64,
        enable_prefix_caching=False,
    )
    prompts = [f"request number {i} asks for a fairly long continuation of its prompt" for i in range(8)]
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    for _ in range(4):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.token_ids) == 30 for o in outputs)
    assert llm.engine.scheduler.num_preemptions > 0
    _all_pages_back(llm.engine)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_forked_samples_in_a_pool_they_fill(tiny_model_dir: Path, async_scheduling: bool) -> None:
    """n = 3 samples of three requests in 10 pages, swapping: the waiting forks hold their prompts'
    pages when the one running sequence swaps itself out, so they give them back (before: no
    progress, ever); every sample's tokens are those of a roomy pool. (n > 1 turns the overlap
    off, so "async" is the engine's path with async scheduling on, its steps not overlapping.)"""
    prompts = [f"The forked samples of a request share this prompt's pages until they {i}" for i in range(3)]
    params = [SamplingParams(n=3, max_tokens=10, ignore_eos=True, temperature=1.0, seed=i) for i in range(3)]

    def samples(llm: LLM) -> list[list[list[int]]]:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [[sample.token_ids for sample in output.outputs] for output in outputs]

    expected = samples(_make(tiny_model_dir, {}, async_scheduling=False))
    llm = _make(tiny_model_dir, {}, async_scheduling, num_pages=10, preemption_mode="swap", num_swap_pages=64)
    assert samples(llm) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    _all_pages_back(llm.engine)
