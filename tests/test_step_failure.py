"""A step that fails (an error injected into the runner's launch, as an out-of-memory would raise
it) leaves an engine that serves the next requests exactly: the requests of the failed step are
aborted, as the server does, and nothing of them stays behind; an adapter whose load the failed
step carried is never served from pages that may not hold its weights, not even to the requests
that keep running on it when a caller of the engine goes on stepping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from adapter_factory import make_peft_adapter

from loraserve import LLM, SamplingParams
from loraserve.lora import weights
from loraserve.page_pool import PageKind

ENGINE = dict(kernels="torch", block_size=4, max_num_seqs=8, num_pages=200)
PROMPT = "A prompt for the adapter that the failed step was loading"
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def adapter_dir(tiny_hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("step_failure")
    targets = ["q_proj", "v_proj", "down_proj"]
    return make_peft_adapter(tiny_hf_model, root / "a", rank=8, target_modules=targets, seed=5)


def _tokens(llm: LLM, adapter: str | None) -> list[int]:
    (output,) = llm.generate([PROMPT], GREEDY, adapters=[adapter], use_tqdm=False)
    return list(output.outputs[0].token_ids)


def _engine_failing_its_first_adapter_write(
    tiny_model_dir: Path, adapter_dir: Path, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> tuple[LLM, list[int], list[int]]:
    """An engine whose first adapter write raises; the tokens of PROMPT with adapter "a" and without."""
    reference = LLM(str(tiny_model_dir), **ENGINE)  # type: ignore[arg-type]
    reference.add_adapter("a", adapter_dir)
    expected, base = _tokens(reference, "a"), _tokens(reference, None)
    assert expected != base  # the adapter changes the tokens: serving it without its weights shows

    llm = LLM(str(tiny_model_dir), async_scheduling=async_scheduling, **ENGINE)  # type: ignore[arg-type]
    llm.add_adapter("a", adapter_dir)
    write = weights.write_adapter_load
    failures: list[str] = []

    def failing_write(storage: Any, load: Any) -> None:
        if not failures:
            failures.append(load.pages.adapter_id)
            raise RuntimeError("injected: out of memory while writing the adapter")
        write(storage, load)

    monkeypatch.setattr("loraserve.pool_storage.write_adapter_load", failing_write)
    return llm, expected, base


def _fail_a_step(engine: Any) -> None:
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(100):  # the first steps may wait for the adapter's files
            engine.step()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_adapter_loaded_by_a_failed_step_is_loaded_again(
    tiny_model_dir: Path, adapter_dir: Path, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    llm, expected, base = _engine_failing_its_first_adapter_write(
        tiny_model_dir, adapter_dir, monkeypatch, async_scheduling
    )
    engine = llm.engine
    engine.add_request("r1", PROMPT, GREEDY, adapter_name="a")
    _fail_a_step(engine)
    engine.abort_request("r1")  # what the server does with the requests of a failed step
    assert not engine.has_unfinished_requests()
    pages = engine.stats().pages_by_kind
    assert pages.get(PageKind.ADAPTER, 0) == pages.get(PageKind.ADAPTER_IDLE, 0) == 0  # freed, not kept idle

    assert _tokens(llm, "a") == expected
    assert engine.adapters.num_loads == 2
    assert _tokens(llm, None) == base
    engine.step()  # hands the runner the rows of the last finished sequences
    assert engine.stats().pages_by_kind.get(PageKind.KV, 0) == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_requests_still_running_on_it_get_it_written(
    tiny_model_dir: Path, adapter_dir: Path, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    """Two requests on the adapter; the step loading it fails and only one is aborted: the other,
    stepped on by the engine's caller, runs on the adapter written again, not on empty pages."""
    llm, expected, _ = _engine_failing_its_first_adapter_write(
        tiny_model_dir, adapter_dir, monkeypatch, async_scheduling
    )
    engine = llm.engine
    engine.add_request("r1", PROMPT, GREEDY, adapter_name="a")
    engine.add_request("r2", PROMPT, GREEDY, adapter_name="a")
    _fail_a_step(engine)
    engine.abort_request("r1")
    finished: dict[str, list[int]] = {}
    for _ in range(100):
        finished |= {out.request_id: list(out.outputs[0].token_ids) for out in engine.step() if out.finished}
        if not engine.has_unfinished_requests():
            break
    assert finished == {"r2": expected} and engine.adapters.num_loads == 2
