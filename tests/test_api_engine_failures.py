"""A request the server accepted and then could not finish gets the same status and reason whether
it streams or not: 500 naming the failure when a step fails (and the server keeps serving), 503
when the engine loop has stopped. Real uvicorn servers over a tiny model; the failures are
injected into the engine's step, as an out-of-memory or a crash of the loop would raise them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from base_model_server import assert_openai_error
from loraserve.api import ServerSettings, ServerThread, create_app

from loraserve.config import EngineConfig
from loraserve.llm_engine import LLMEngine

MODEL = "tiny"
COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}
ROUTES = (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT))


@pytest.fixture(name="served")
def served_fixture(tiny_model_dir: Path) -> Iterator[tuple[httpx.Client, LLMEngine]]:
    config = EngineConfig(model=str(tiny_model_dir), kernels="torch", num_pages=64, max_num_seqs=4)
    engine = LLMEngine(config)
    server = ServerThread(create_app(engine, ServerSettings(model_id=MODEL)))
    with server, httpx.Client(base_url=server.url, timeout=60) as http:
        yield http, engine


def _fail_next_steps(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, error: BaseException, times: int) -> None:
    step = engine.step
    failures = [error] * times

    def failing_step() -> Any:
        if failures:
            raise failures.pop()
        return step()

    monkeypatch.setattr(engine, "step", failing_step)


def _stream_error(response: httpx.Response) -> dict[str, Any]:
    """The error event of an SSE response that started with 200."""
    assert response.status_code == 200, response.text
    events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    errors = [json.loads(event)["error"] for event in events if event != "[DONE]" and "error" in json.loads(event)]
    assert len(errors) == 1, response.text
    return errors[0]


def test_a_failed_step_is_a_500_naming_it_streamed_or_not(
    served: tuple[httpx.Client, LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    http, engine = served
    _fail_next_steps(engine, monkeypatch, RuntimeError("injected: out of memory"), times=4)
    for route, body in ROUTES:
        error = assert_openai_error(http.post(route, json=body), 500)
        assert "the engine failed while running this request: injected: out of memory" in error["message"]
        streamed = _stream_error(http.post(route, json={**body, "stream": True}))
        assert streamed["code"] == 500 and "injected: out of memory" in streamed["message"]
    for route, body in ROUTES:  # the failures were the steps', not the server's: it serves on
        assert http.post(route, json=body).status_code == 200


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop's thread dies
def test_a_stopped_engine_loop_is_a_503_streamed_or_not(
    served: tuple[httpx.Client, LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    http, engine = served
    _fail_next_steps(engine, monkeypatch, SystemExit("injected: the loop dies"), times=1)
    error = assert_openai_error(http.post("/v1/completions", json=COMPLETION), 503)
    assert "the engine loop stopped" in error["message"]
    for route, body in ROUTES:  # later requests are refused at once, with the same status
        assert "the engine is not running" in assert_openai_error(http.post(route, json=body), 503)["message"]
        refused = http.post(route, json={**body, "stream": True})
        assert "the engine is not running" in assert_openai_error(refused, 503)["message"]
