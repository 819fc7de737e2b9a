"""The base model behind a real uvicorn server, shared by the HTTP API tests: one server per test
module (module-scoped fixtures), its clients, and helpers that read /metrics and OpenAI errors."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from loraserve.api import ServerSettings, ServerThread, create_app
from prometheus_client.parser import text_string_to_metric_families

from loraserve.config import EngineConfig
from loraserve.llm_engine import LLMEngine

MODEL = "smol"
PROMPT = "The capital of France is"
PROMPT_TOKEN = 504  # any token id of the default model's vocabulary
USER_HI = {"role": "user", "content": "Hi"}


@pytest.fixture(scope="module", name="server")
def server_fixture() -> Iterator[tuple[ServerThread, LLMEngine]]:
    engine = LLMEngine(EngineConfig(num_pages=96, max_num_seqs=8, max_num_batched_tokens=512))
    with ServerThread(create_app(engine, ServerSettings(model_id=MODEL))) as running:
        yield running, engine


@pytest.fixture(scope="module", name="http")
def http_fixture(server: tuple[ServerThread, LLMEngine]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0].url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module", name="client")
def client_fixture(server: tuple[ServerThread, LLMEngine]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric_values(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = http.get("/metrics")
    assert response.status_code == 200
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def wait_until_idle(http: httpx.Client, engine: LLMEngine, timeout: float = 30.0) -> dict[Any, float]:
    """Poll /metrics (read on the engine thread) until nothing runs and every page is free."""
    deadline = time.monotonic() + timeout
    while True:
        values = metric_values(http)
        free = values[("loraserve_pool_pages", (("kind", "free"),))]
        cached = values[("loraserve_pool_pages", (("kind", "prefix_cache"),))]  # unreferenced, evictable
        idle = values[("loraserve_requests_running", ())] == 0 and values[("loraserve_requests_waiting", ())] == 0
        if idle and free + cached == engine.pool.num_pages:
            return values
        assert time.monotonic() < deadline, f"engine still busy: free={free} of {engine.pool.num_pages}"
        time.sleep(0.1)


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status  # vLLM's: the HTTP status
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}.get(status, error["type"])
    assert isinstance(error["message"], str) and error["message"]
    return error


def token_texts(http: httpx.Client, token_ids: list[int]) -> list[str]:
    return [http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in token_ids]


def made_of(text: str, pieces: list[str]) -> bool:
    """Whether ``text`` is a concatenation of ``pieces`` (each any number of times)."""
    while text:
        piece = next((p for p in pieces if p and text.startswith(p)), None)
        if piece is None:
            return False
        text = text[len(piece) :]
    return True
