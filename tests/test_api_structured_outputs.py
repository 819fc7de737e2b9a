"""Structured outputs over HTTP as vLLM 0.32 serves them: OpenAI's ``response_format``
(``json_schema``, ``json_object``) and vLLM's ``structured_outputs`` (``choice``, ``regex``, ...),
whole and streamed, through OpenAI's client too; malformed constraints and options loraserve does
not implement refused with a 400 naming the field."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest
from base_model_server import (  # noqa: F401 (pytest fixtures: client, http, server)
    MODEL,
    assert_openai_error,
    client_fixture,
    http_fixture,
    server_fixture,
)

pytestmark = pytest.mark.slow

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}, "millions": {"type": "integer",
                   "minimum": 0, "maximum": 99}},
    "required": ["city", "millions"],
    "additionalProperties": False,
}  # fmt: skip
ASK = [{"role": "user", "content": "Which city is the capital of France, and how many millions live there? JSON."}]


def test_response_format_json_schema_and_json_object(client: openai.OpenAI) -> None:
    schema_format: Any = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, temperature=0, response_format=schema_format
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    value = json.loads(choice.message.content or "")
    assert value["city"] in ("Paris", "Lyon") and 0 <= value["millions"] <= 99 and set(value) == set(CITY["required"])
    sampled = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, temperature=1.0, seed=4, n=3, response_format={"type": "json_object"}
    )
    for choice in sampled.choices:
        text = choice.message.content or ""
        assert text.startswith("{"), text
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_structured_outputs_choice_and_regex_whole_and_streamed(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Is Paris in France? Answer:", "max_tokens": 10, "temperature": 1.0, "n": 4}
    reply = http.post("/v1/completions", json={**body, "structured_outputs": {"choice": ["yes", "no"]}})
    assert reply.status_code == 200, reply.text
    assert {c["text"] for c in reply.json()["choices"]} <= {"yes", "no"}
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    streamed = {"model": MODEL, "prompt": "Call me at", "max_tokens": 30, "stream": True,
                "structured_outputs": {"regex": phone}}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=streamed) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert stream.status_code == 200
    assert re.fullmatch(phone, "".join(c["choices"][0]["text"] for c in chunks))
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    for grammar in ("root ::= [0-9]+", "start: /[0-9]+/"):  # EBNF, Lark
        chat = {"model": MODEL, "messages": ASK, "max_tokens": 20, "structured_outputs": {"grammar": grammar}}
        content = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
        assert re.fullmatch(r"[0-9]+", content), (grammar, content)


def test_bad_constraints_name_the_field(http: httpx.Client) -> None:
    base = {"model": MODEL, "prompt": "x", "max_tokens": 5}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"structured_outputs": {"regex": "("}}, "structured_outputs", "structured_outputs.regex: Regex parsing"),
        ({"structured_outputs": {"json": "{bad"}}, "structured_outputs", "structured_outputs.json: "),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty strings"),
        ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs", 'Rule "nothing"'),
        ({"structured_outputs": {"grammar": "start: nothing"}}, "structured_outputs", "unknown name 'nothing'"),
        ({"structured_outputs": {"regx": "a"}}, "structured_outputs", "no field 'regx'"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "not supported"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "'json_schema' field must be provided"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wrong"}}}},
         "response_format", "response_format.json_schema.schema: "),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
    ]  # fmt: skip
    for fields, param, message in cases:
        error = assert_openai_error(http.post("/v1/completions", json={**base, **fields}), 400)
        assert error["param"] == param and message in error["message"], (fields, error)
    combined = {**base, "structured_outputs": {"regex": "a"}, "min_tokens": 1}
    assert "cannot be combined" in assert_openai_error(http.post("/v1/completions", json=combined), 400)["message"]
    assert http.post("/v1/completions", json={**base, "response_format": {"type": "text"}}).status_code == 200
