"""Redis killed under a running server (real redis-server, real uvicorn, tiny model), then restarted.

While it is down: the adapter already resident keeps being served, a registered adapter not
loaded yet answers 503 naming the registry (JSON and streamed), a read that was in flight when
Redis died fails only its own request with 503, upload/delete/list answer 503, base-model
requests go on, ``loraserve_registry_up`` reads 0, and the outage is logged once. Redis comes
back on the same port with its data (append-only file): the replica reconnects by itself within
seconds, the gauge reads 1, the adapter that needed the store is served, uploads work again.
Throughout, no registry call ran on the engine thread.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from adapter_factory import make_peft_adapter
from loraserve.adapters import RedisStore
from loraserve.api import ServerSettings, ServerThread, create_app
from prometheus_client.parser import text_string_to_metric_families
from redis_process import RedisProcess

from loraserve.config import EngineConfig
from loraserve.llm_engine import LLMEngine

MODEL = "tiny"
PROMPT = "Registries fail; replicas should not."
ENGINE_THREAD = "loraserve-engine"  # api/async_engine.py names its thread so


def adapter_files(tiny_hf_model: Any, directory: Path, seed: int) -> dict[str, bytes]:
    path = make_peft_adapter(tiny_hf_model, directory, rank=4, target_modules=["q_proj", "v_proj"], seed=seed)
    return {name: (path / name).read_bytes() for name in ("adapter_config.json", "adapter_model.safetensors")}


def upload(http: httpx.Client, name: str, files: dict[str, bytes]) -> httpx.Response:
    parts = [("files", (file_name, data, "application/octet-stream")) for file_name, data in files.items()]
    return http.post("/v1/adapters", data={"name": name}, files=parts)


def complete(http: httpx.Client, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}
    return http.post("/v1/completions", json=body)


def registry_up(http: httpx.Client) -> float:
    response = http.get("/metrics")
    assert response.status_code == 200
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "loraserve_registry_up":
                return sample.value
    raise AssertionError("loraserve_registry_up missing from /metrics")


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def assert_registry_503(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == 503 and "adapter registry redis://127.0.0.1" in error["message"], error


def record_store_threads(store: RedisStore) -> list[tuple[str, str]]:
    """Wrap the store's calls so each records (method, calling thread)."""
    calls: list[tuple[str, str]] = []
    for method in ("put", "get", "delete", "names", "contains", "content_key", "get_content", "index"):
        original = getattr(store, method)

        @functools.wraps(original)
        def recorded(*args: Any, _original: Any = original, _method: str = method, **kwargs: Any) -> Any:
            calls.append((_method, threading.current_thread().name))
            return _original(*args, **kwargs)

        setattr(store, method, recorded)
    return calls


@pytest.fixture()
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path / "redis").start()
    yield server
    server.stop()


def test_a_registry_outage_fails_only_what_needs_the_registry_and_heals_by_itself(
    tiny_model_dir: Path,
    tiny_hf_model: Any,
    tmp_path: Path,
    redis_server: RedisProcess,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = EngineConfig(
        model=str(tiny_model_dir), registry=redis_server.url, num_pages=128, max_num_seqs=8, kernels="torch"
    )
    engine = LLMEngine(config)
    store = engine.adapter_registry.store
    assert isinstance(store, RedisStore)
    calls = record_store_threads(store)
    caplog.set_level(logging.INFO, logger="loraserve.adapters.catalog")
    files = {
        name: adapter_files(tiny_hf_model, tmp_path / name, seed)
        for seed, name in enumerate(["warm", "cold", "late", "after"])
    }
    with (
        ServerThread(create_app(engine, ServerSettings(model_id=MODEL))) as running,
        httpx.Client(base_url=running.url, timeout=60) as http,
    ):
        for name in ("warm", "cold", "late"):
            assert upload(http, name, files[name]).status_code == 201
        warm_before = complete(http, "warm")
        assert warm_before.status_code == 200 and registry_up(http) == 1

        # A read of "late" in flight when Redis dies: the loader thread is held until then.
        release = threading.Event()
        engine.adapters.resolver._loader.submit(release.wait)
        late: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: late.append(complete(http, "late")))
        waiter.start()
        wait_until(lambda: bool(engine.scheduler.loading), 10, "the request for 'late' waits for its files")

        redis_server.kill()
        wait_until(lambda: registry_up(http) == 0, 3, "the gauge reads 0")
        release.set()
        waiter.join(30)
        assert_registry_503(late[0])  # only the request that needed the read

        warm = complete(http, "warm")  # resident: served as before, same weights
        assert warm.status_code == 200 and warm.json()["choices"][0]["text"] == warm_before.json()["choices"][0]["text"]
        assert_registry_503(complete(http, "cold"))
        streamed = complete(http, "cold", stream=True)
        assert_registry_503(streamed)  # refused before the stream starts
        assert_registry_503(upload(http, "after", files["after"]))
        assert_registry_503(http.delete("/v1/adapters/warm"))
        assert_registry_503(http.get("/v1/adapters"))
        assert complete(http, MODEL).status_code == 200  # the engine keeps serving
        assert http.get("/health").status_code == 200

        redis_server.start()  # same port; the append-only file brings the adapters back
        wait_until(lambda: registry_up(http) == 1, 5, "the replica reconnects by itself")
        assert complete(http, "cold").status_code == 200
        assert complete(http, "late").status_code == 200
        assert upload(http, "after", files["after"]).status_code == 201
        assert complete(http, "after").status_code == 200
        assert {card["id"] for card in http.get("/v1/adapters").json()["data"]} == {"warm", "cold", "late", "after"}

    messages = [record.getMessage() for record in caplog.records if record.name == "loraserve.adapters.catalog"]
    assert sum("unreachable" in message for message in messages) == 1, messages  # once per outage
    assert sum("reachable again" in message for message in messages) == 1, messages
    assert [call for call in calls if call[1] == ENGINE_THREAD] == []  # no registry call on the engine thread
    assert {thread for _, thread in calls} >= {"loraserve-adapter-load_0"}  # reads happened, on the loader


def test_a_read_failed_for_want_of_the_registry_streams_a_503_event() -> None:
    """The streamed twin of the in-flight read above: the stream has started, so the 503 is an event."""
    from loraserve.api.request_stream import RequestFailedError
    from loraserve.api.streaming import sse_error

    failed = RequestFailedError("adapter 'late' could not be loaded: the adapter registry ...", "registry_unavailable")
    event = json.loads(sse_error(failed).removeprefix("data: "))
    assert event["error"]["code"] == 503 and "adapter registry" in event["error"]["message"]
    assert json.loads(sse_error(RequestFailedError("damaged")).removeprefix("data: "))["error"]["code"] == 500
