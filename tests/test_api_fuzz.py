"""Every endpoint fuzzed from the app's own OpenAPI schema (schemathesis, a bounded number of
examples per operation): no 5xx, every 4xx in the OpenAI error shape; afterwards the server is
healthy, nothing runs and every page is free. Hand-made hostile bodies besides: wrong types,
negative and huge numbers, invalid UTF-8 and JSON, unknown fields, and streams cut by the client
after each chunk."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from loraserve.api import ServerSettings, ServerThread, create_app

from loraserve.config import EngineConfig
from loraserve.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

MODEL = "base"
EXAMPLES = 20  # per operation: a bounded CI run (raise it locally to fuzz harder); twice that for generation
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, LLMEngine]]:
    tmp = tmp_path_factory.mktemp("fuzz")
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_pages=256, max_num_seqs=8, kernels="torch",
                                    registry=f"dir:{tmp / 'registry'}"))  # fmt: skip
    # Small output limits keep each fuzzed generation short (larger asks are refused with a 400).
    settings_ = ServerSettings(model_id=MODEL, max_output_tokens=8, max_n=3, max_upload_bytes=2**20)
    with ServerThread(create_app(engine, settings_)) as running:
        yield running.url, engine


def test_every_operation_fuzzed_from_the_schema(server: tuple[str, LLMEngine]) -> None:
    """Each operation of /openapi.json, ``EXAMPLES`` generated requests: no 5xx, 4xx in OpenAI's shape."""
    url, engine = server
    schema = schemathesis.openapi.from_dict(httpx.get(url + "/openapi.json").json())
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12  # every route of the API, from the app's own schema
    for operation in operations:
        examples = 2 * EXAMPLES if "completions" in operation.label else EXAMPLES

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def check(case: Any) -> None:
            if isinstance(case.body, dict) and "model" in case.body and len(str(case.body)) % 4:
                case.body["model"] = MODEL  # most bodies name the served model, to reach past the lookup
            response = case.call(base_url=url, timeout=120)
            assert response.status_code < 500, f"{case.as_curl_command()}\n{response.status_code} {response.text[:500]}"
            if 400 <= response.status_code < 500:
                body = response.json()
                if body.get("type") == "error" and "/v1/messages" in case.operation.label:  # Anthropic's shape
                    assert set(body["error"]) == {"type", "message"}, response.text[:500]
                    return
                error = body["error"]
                assert set(error) == ERROR_KEYS and error["code"] == response.status_code, response.text[:500]

        check()
    _idle(url, engine)


def _idle(url: str, engine: LLMEngine) -> None:
    """The server answers, nothing runs or waits, and every page is free or evictable cache."""
    deadline = time.monotonic() + 30
    while True:
        health = httpx.get(url + "/health")
        metrics = httpx.get(url + "/metrics").text
        queues = ("loraserve_requests_running ", "loraserve_requests_waiting ")
        running = [line for line in metrics.splitlines() if line.startswith(queues)]
        if health.status_code == 200 and all(float(line.split()[1]) == 0 for line in running):
            break
        assert time.monotonic() < deadline, (health.text, running)
        time.sleep(0.1)
    pool = engine.pool
    assert pool.num_free_pages + pool.num_evictable_pages == pool.num_pages


def test_hand_made_hostile_bodies(server: tuple[str, LLMEngine]) -> None:
    url, engine = server
    base = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    bodies: list[Any] = [
        {**base, "max_tokens": -1}, {**base, "max_tokens": 10**12}, {**base, "max_tokens": "many"},
        {**base, "n": 10**9}, {**base, "n": -3}, {**base, "logprobs": 10**6}, {**base, "temperature": "hot"},
        {**base, "prompt": "word " * 5000}, {**base, "prompt": [[]]}, {**base, "prompt": [-5]},
        {**base, "prompt": {"nested": True}}, {**base, "stop": [1, 2]}, {**base, "seed": 2**63},
        {**base, "logit_bias": {"a": "b"}}, {**base, "stream_options": "yes"}, [], "just a string", 17,
    ]  # fmt: skip
    for body in bodies:
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert 400 <= reply.status_code < 500, (body, reply.text)
        assert set(reply.json()["error"]) == ERROR_KEYS
    for raw in (b"\xff\xfe{not utf8", b'{"model": "base", "prompt": "\xc3\x28"}', b"{" * 10000, b""):
        reply = httpx.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert 400 <= reply.status_code < 500 and set(reply.json()["error"]) == ERROR_KEYS, raw[:40]
    unknown = httpx.post(url + "/v1/completions", json={**base, "totally_unknown_field": [1, 2]})
    assert unknown.status_code == 200  # ignored, as vLLM ignores fields it does not define
    for role in ("", 7, None):  # any other role goes to the chat template, as in vLLM
        chat = {"model": MODEL, "messages": [{"role": role, "content": "x"}]}
        assert httpx.post(url + "/v1/chat/completions", json=chat).status_code == 400
    _idle(url, engine)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_streams_cut_by_the_client_after_each_chunk(server: tuple[str, LLMEngine], endpoint: str) -> None:
    url, engine = server
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "ignore_eos": True, "stream": True, "n": 2,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    body |= (
        {"prompt": "Once upon"}
        if endpoint.endswith("/completions") and "chat" not in endpoint
        else {"messages": [{"role": "user", "content": "Once upon"}]}
    )
    with httpx.stream("POST", url + endpoint, json=body, timeout=60) as reply:
        total = sum(1 for line in reply.iter_lines() if line.startswith("data: "))
    assert total > 3
    for cut_after in range(total):
        with httpx.stream("POST", url + endpoint, json=body, timeout=60) as reply:
            seen = 0
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    if seen == cut_after:
                        break  # the client goes away: the server aborts the request
                    if line != "data: [DONE]":
                        json.loads(line[6:])
                    seen += 1
    _idle(url, engine)


def test_after_the_fuzz_the_server_is_healthy_and_every_page_free(server: tuple[str, LLMEngine]) -> None:
    url, engine = server
    _idle(url, engine)
    reply = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
