"""``POST /invocations`` (SageMaker's route, as vLLM 0.32 serves it): a chat body answered as
``/v1/chat/completions`` answers it and a completion body as ``/v1/completions`` does, whole and
streamed; SageMaker's adapter header names the model; a body of neither kind, or a broken one,
refused by name."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from base_model_server import (  # noqa: F401 (pytest fixtures: http, server)
    MODEL,
    PROMPT,
    USER_HI,
    assert_openai_error,
    http_fixture,
    server_fixture,
)

pytestmark = pytest.mark.slow

CHAT = {"model": MODEL, "messages": [USER_HI], "max_tokens": 8, "temperature": 0, "logprobs": True}
COMPLETION = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2}


def _answer(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    answer["usage"].pop("prompt_tokens_details", None)  # the second ask hits the first's cached prefix
    return {key: value for key, value in answer.items() if key not in ("id", "created")}


def test_chat_and_completion_bodies_are_answered_as_their_routes_answer(http: httpx.Client) -> None:
    chat = _answer(http, "/invocations", CHAT)
    assert chat["object"] == "chat.completion" and chat == _answer(http, "/v1/chat/completions", CHAT)
    completion = _answer(http, "/invocations", COMPLETION)
    assert completion["object"] == "text_completion" and completion == _answer(http, "/v1/completions", COMPLETION)
    with http.stream("POST", "/invocations", json={**CHAT, "stream": True}) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert stream.status_code == 200 and lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in lines[:-1])
    assert text == chat["choices"][0]["message"]["content"]


def test_the_sagemaker_adapter_header_names_the_model(http: httpx.Client) -> None:
    headers = {"X-Amzn-SageMaker-Adapter-Identifier": "no-such-adapter"}
    error = assert_openai_error(http.post("/invocations", json=COMPLETION, headers=headers), 404)
    assert "no-such-adapter" in error["message"], error
    headers = {"X-Amzn-SageMaker-Adapter-Identifier": MODEL}
    response = http.post("/invocations", json={**COMPLETION, "model": "not-served"}, headers=headers)
    assert response.status_code == 200, response.text


def test_bodies_of_neither_kind_or_broken_ones_are_refused_by_name(http: httpx.Client) -> None:
    for body in ({"model": MODEL, "input": "Hi"}, [1, 2], "text"):
        error = assert_openai_error(http.post("/invocations", json=body), 400)
        assert error["message"] == (
            "Cannot find suitable handler for request. Expected one of: ['ChatCompletionRequest', 'CompletionRequest']"
        )
    error = assert_openai_error(http.post("/invocations", json={**CHAT, "temperature": "hot"}), 400)
    assert error["param"] == "temperature", error  # a chat body's own problem, not "neither kind"
    error = assert_openai_error(http.post("/invocations", json={**COMPLETION, "max_tokens": -1}), 400)
    assert error["param"] == "max_tokens", error
    broken = http.post("/invocations", content=b'{"prompt": ', headers={"Content-Type": "application/json"})
    assert assert_openai_error(broken, 400)["message"].startswith("JSON decode error: ")
    assert http.post("/invocations", content=b"{}", headers={"Content-Type": "text/plain"}).status_code == 400
    nested = http.post("/invocations", content=b"[" * 5000, headers={"Content-Type": "application/json"})
    assert "JSON decode error" in assert_openai_error(nested, 400)["message"]
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # valid JSON nested past Python's recursion limit
    response = http.post("/invocations", content=deep, headers={"Content-Type": "application/json"})
    assert "nested too deeply" in assert_openai_error(response, 400)["message"]
    schema = http.get("/openapi.json").json()["paths"]["/invocations"]["post"]["requestBody"]
    refs = [ref["$ref"] for ref in schema["content"]["application/json"]["schema"]["anyOf"]]
    components = http.get("/openapi.json").json()["components"]["schemas"]
    assert all(ref.rsplit("/", 1)[1] in components for ref in refs)  # documented with both bodies
