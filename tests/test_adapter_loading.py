"""Adapters load in the background: the engine keeps serving while one is read and parsed.

The manager has one loader thread; the tests occupy it with a task that waits on an event,
so a load is held back for exactly as long as a test needs. Where the forward leaves host cores
idle, the loader thread parses the files too (the manager-level tests at the end).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from adapter_factory import make_peft_adapter
from loraserve.adapters import AdapterError
from residency_env import QV, Env, base_fixture  # noqa: F401 (pytest fixture: base)

from api.request_stream import RequestFailedError
from loraserve import LLM, SamplingParams
from loraserve.engine_memory import host_cores_to_spare
from loraserve.input_processor import RequestError
from loraserve.outputs import REQUEST_TOO_LARGE, RequestOutput
from loraserve.sequence import SequenceStatus

PROMPT = "The weather today is"
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), num_pages=256)


@pytest.fixture(scope="module")
def adapter_dir(tiny_hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loading")
    return make_peft_adapter(tiny_hf_model, root / "a", rank=8, target_modules=["q_proj", "v_proj"], seed=3)


def hold_loader(llm: LLM) -> threading.Event:
    """Occupy the adapter loader thread until the returned event is set."""
    release = threading.Event()
    llm.engine.adapters.resolver._loader.submit(release.wait)
    return release


def add_while_loading(llm: LLM, request_id: str, params: SamplingParams, adapter: str) -> None:
    """Queue a request while the loader thread is busy, so the adapter's size is not known yet."""
    release = hold_loader(llm)
    try:
        llm.engine.add_request(request_id, PROMPT, params, adapter)
    finally:
        release.set()


def run(llm: LLM) -> dict[str, RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    while llm.engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in llm.engine.step() if o.finished})
    return finished


def test_base_requests_run_while_an_adapter_loads(llm: LLM, adapter_dir: Path) -> None:
    engine = llm.engine
    llm.add_adapter("slow", adapter_dir, overwrite=True)
    release = hold_loader(llm)
    try:
        engine.add_request("lora", PROMPT, PARAMS, "slow")
        engine.add_request("base", PROMPT, PARAMS)
        assert [seq.request_id for seq in engine.scheduler.loading] == ["lora"]
        finished: dict[str, RequestOutput] = {}
        while "base" not in finished:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        lora_seq = engine.requests["lora"].seqs[0]
        assert lora_seq.status is SequenceStatus.WAITING_FOR_ADAPTER and lora_seq not in engine.scheduler.waiting
        assert lora_seq.adapter_id is None and [seq.request_id for seq in engine.scheduler.loading] == ["lora"]
    finally:
        release.set()
    finished.update(run(llm))
    assert not engine.scheduler.loading and not engine.requests
    assert finished["lora"].outputs[0].finish_reason == "length"
    # The same request with the adapter already in host memory (resolved synchronously):
    again = llm.generate([PROMPT], PARAMS, adapters="slow", use_tqdm=False)[0]
    assert finished["lora"].token_ids == again.token_ids != finished["base"].token_ids


def test_abort_while_loading_leaves_nothing_behind(llm: LLM, adapter_dir: Path) -> None:
    engine = llm.engine
    llm.add_adapter("aborted", adapter_dir, overwrite=True)
    release = hold_loader(llm)
    try:
        request = engine.add_request("gone", PROMPT, PARAMS, "aborted")
        other = engine.add_request("gone too", PROMPT, PARAMS, "aborted")
        loads = engine.adapters.resolver._loads
        read = loads["aborted"].future
        engine.abort_request("gone")
        assert "aborted" in loads  # another request still waits for the read
        engine.abort_request("gone too")
        assert not engine.has_unfinished_requests() and not engine.scheduler.loading
        assert request.seqs[0].finish_reason is not None and request.seqs[0].finish_reason.value == "abort"
        assert other.seqs[0].finish_reason is not None
        assert "aborted" not in loads and read.cancelled()  # not read for nobody, nor held after
    finally:
        release.set()
    assert llm.generate([PROMPT], PARAMS, adapters="aborted", use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_an_adapter_that_fails_to_load_ends_only_its_requests(llm: LLM, adapter_dir: Path, tmp_path: Path) -> None:
    """Stored files corrupted after registration: the requests waiting for them end with ``abort``
    and the read's error, all from one read, however their arrivals fall around it; others are
    served; a request for that content right after gets the same error; new content loads."""
    engine = llm.engine
    llm.add_adapter("corrupt", adapter_dir, overwrite=True)
    store_root = Path(engine.adapter_registry.store.root)
    weights = (store_root / "corrupt").resolve() / "adapter_model.safetensors"
    weights.write_bytes(b"not a safetensors file")
    source = engine.adapters.resolver.source
    reads: list[str] = []
    read = source.read

    def counted(name: str, key: str) -> Any:
        reads.append(name)
        return read(name, key)

    source.read = counted  # type: ignore[method-assign]
    try:
        outputs = llm.generate([PROMPT] * 5, PARAMS, adapters=["corrupt"] * 4 + [None], use_tqdm=False)
        for output in outputs[:4]:
            assert output.outputs[0].finish_reason == "abort" and output.token_ids == []
            assert output.error is not None and "'corrupt' could not be loaded" in output.error
            assert output.error_code == "invalid_adapter"  # a 400 over HTTP: retrying cannot help
        assert reads == ["corrupt"]
        assert outputs[4].error is None
        assert outputs[4].outputs[0].finish_reason == "length" and len(outputs[4].token_ids) == 6
        assert not engine.scheduler.loading and not engine.requests
        again = llm.generate([PROMPT], PARAMS, adapters="corrupt", use_tqdm=False)[0]
        assert again.error is not None and "'corrupt' could not be loaded" in again.error
        assert reads == ["corrupt"]
        other = shutil.copytree(adapter_dir, tmp_path / "other")  # other content: read again, served
        config = json.loads((other / "adapter_config.json").read_text())
        (other / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": config["lora_alpha"] + 1}))
        llm.add_adapter("corrupt", other, overwrite=True)
        assert llm.generate([PROMPT], PARAMS, adapters="corrupt", use_tqdm=False)[0].error is None
    finally:
        source.read = read  # type: ignore[method-assign]


def test_an_adapter_deleted_before_its_files_are_read_ends_its_requests_as_not_found(
    llm: LLM, adapter_dir: Path
) -> None:
    """Deleted between the request's lookup and the read on the loader thread: its requests end with
    ``error_code`` ``adapter_not_found`` (a 404 over HTTP, as a name never registered)."""
    engine = llm.engine
    llm.add_adapter("fleeting", adapter_dir, overwrite=True)
    source = engine.adapters.resolver.source
    read = source.read

    def deleted_first(name: str, key: str) -> Any:
        engine.adapter_registry.store.delete(name)
        return read(name, key)

    source.read = deleted_first  # type: ignore[method-assign]
    try:
        output = llm.generate([PROMPT], PARAMS, adapters="fleeting", use_tqdm=False)[0]
    finally:
        source.read = read  # type: ignore[method-assign]
    assert output.outputs[0].finish_reason == "abort" and output.error_code == "adapter_not_found"
    assert output.error is not None and "'fleeting' could not be loaded" in output.error
    assert RequestFailedError(output.error, output.error_code).status_code == 404


def test_a_request_too_large_with_its_adapter_ends_with_a_request_error(
    tiny_model_dir: Path, adapter_dir: Path
) -> None:
    """A request that fits the pool without its adapter's pages but not with them: known only once
    the adapter is read, it ends with ``abort``, ``error_code`` ``request_too_large`` (a 400 over
    HTTP, not a server failure); the same request on the base model is accepted."""
    llm = LLM(str(tiny_model_dir), num_pages=64)  # 1,024 tokens: the pool binds, not the context
    engine = llm.engine
    llm.add_adapter("roomy", adapter_dir, overwrite=True)
    prompt_len = len(engine.tokenizer.encode(PROMPT))
    assert engine.max_seq_tokens < engine.max_model_len  # the pool is the binding limit
    too_large = SamplingParams(temperature=0.0, max_tokens=engine.max_seq_tokens - prompt_len, ignore_eos=True)
    add_while_loading(llm, "big", too_large, "roomy")
    finished = run(llm)
    assert finished["big"].error_code == REQUEST_TOO_LARGE and finished["big"].outputs[0].finish_reason == "abort"
    assert finished["big"].error is not None and "needs more pages than the pool holds" in finished["big"].error
    assert not engine.scheduler.loading and not engine.requests
    assert RequestFailedError(finished["big"].error, finished["big"].error_code).status_code == 400
    with pytest.raises(RequestError, match="needs more pages"):  # once the adapter is known: refused at once
        engine.add_request("big-again", PROMPT, too_large, "roomy")
    engine.add_request("base", PROMPT, too_large)  # the same size fits without the adapter's pages
    engine.abort_request("base")
    assert not engine.requests
    engine.close()


def test_max_tokens_lowered_to_the_pool_counts_the_adapters_pages(tiny_model_dir: Path, adapter_dir: Path) -> None:
    """``lower_max_tokens_to_pool`` (the HTTP server's rule): the same request runs, with max_tokens
    lowered to what the pool holds after the prompt and the adapter's pages, whether the adapter's
    size is known at arrival or only once it is read; a min_tokens past that room is refused."""
    llm = LLM(str(tiny_model_dir), num_pages=64)
    engine = llm.engine
    llm.add_adapter("roomy", adapter_dir, overwrite=True)
    prompt_len = len(engine.tokenizer.encode(PROMPT))
    lowered = SamplingParams(
        temperature=0.0, max_tokens=engine.max_seq_tokens - prompt_len, ignore_eos=True, lower_max_tokens_to_pool=True
    )
    add_while_loading(llm, "loading", lowered, "roomy")
    finished = run(llm)
    adapter_id = engine.adapters.resolver.resolve("roomy")
    room = engine.max_seq_tokens - engine.adapters.num_pages(adapter_id) * engine.config.block_size - prompt_len
    assert 1 <= room < lowered.max_tokens
    assert finished["loading"].error is None and len(finished["loading"].outputs[0].token_ids) == room
    engine.add_request("known", PROMPT, lowered, "roomy")  # the adapter's size known at arrival
    finished = run(llm)
    assert finished["known"].error is None and len(finished["known"].outputs[0].token_ids) == room
    engine.add_request("base", PROMPT, dataclasses.replace(lowered, max_tokens=3))  # nothing to lower
    assert len(run(llm)["base"].outputs[0].token_ids) == 3
    with pytest.raises(RequestError, match=f"min_tokens \\({room + 1}\\) is more than the pool holds"):
        engine.add_request("min", PROMPT, dataclasses.replace(lowered, min_tokens=room + 1), "roomy")
    assert not engine.requests
    engine.close()


def test_close_stops_the_engines_background_threads(tiny_model_dir: Path) -> None:
    import time

    def catalog_threads() -> int:
        return sum(t.name == "loraserve-adapter-catalog" and t.is_alive() for t in threading.enumerate())

    before = catalog_threads()
    llm = LLM(str(tiny_model_dir), kernels="torch", num_pages=64)
    assert catalog_threads() == before + 1
    assert llm.engine.private_registry_dir is not None
    registry_dir = Path(llm.engine.private_registry_dir)
    llm.engine.close()
    deadline = time.monotonic() + 5
    while catalog_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert catalog_threads() == before and not registry_dir.exists()


def test_an_engine_alive_at_exit_stops_its_registry_before_removing_it(tiny_model_dir: Path) -> None:
    """No 'registry unreachable' warning when a script ends without close(): the catalog thread
    stops before the private registry directory is removed. A finalizer made before the engine
    runs after the engine's at exit; its 1 s pause gives a catalog still running (it polls every
    0.2 s) the time to find its directory gone."""
    import subprocess
    import sys

    script = (
        "import time, weakref; anchor = type('Anchor', (), {})(); weakref.finalize(anchor, time.sleep, 1.0); "
        "from loraserve import LLM; "
        f"llm = LLM({str(tiny_model_dir)!r}, kernels='torch', num_pages=64); "
        "print(llm.engine.private_registry_dir, flush=True)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "unreachable" not in done.stderr, done.stderr
    assert not Path(done.stdout.strip().splitlines()[-1]).exists()


def test_the_loader_thread_parses_where_the_forward_leaves_cores_spare(tmp_path: Path, base: Any) -> None:
    """Parsed on either thread, an adapter has the same digest and lands in its pages the same."""
    digests = {}
    for background in (False, True):
        env = Env(tmp_path / str(background), base, num_pages=64, parse_in_background=background)
        try:
            digests[background] = env.add("a", 4, QV)
            engine_thread = threading.current_thread().name
            assert env.registry.parse_threads == ["loraserve-adapter-load_0" if background else engine_thread]
            assert env.manager.acquire(digests[background])
            env.check_weights("a", digests[background])
        finally:
            env.manager.close()
    assert digests[True] == digests[False]


def test_a_parse_error_on_the_loader_thread_reaches_the_resolve(tmp_path: Path, base: Any) -> None:
    env = Env(tmp_path, base, num_pages=64, parse_in_background=True)
    try:
        env.add("good", 2, QV)
        env.manager.resolver.register_from_path("bad", str(tmp_path / "good"))
        weights = (tmp_path / "store" / "bad").resolve() / "adapter_model.safetensors"
        weights.write_bytes(b"not a safetensors file")
        with pytest.raises(AdapterError, match="not a valid safetensors file"):
            env.manager.resolve("bad")
        assert env.registry.parse_threads == ["loraserve-adapter-load_0"] * 2
    finally:
        env.manager.close()


def test_host_cores_are_spare_on_a_gpu_or_with_fewer_torch_threads_than_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = len(os.sched_getaffinity(0))
    assert host_cores_to_spare("cuda")
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert not host_cores_to_spare("cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores - 1)
    assert host_cores_to_spare("cpu") == (cores > 1)
