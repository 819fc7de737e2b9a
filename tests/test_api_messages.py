"""``/v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API) as vLLM 0.32
serves them for a chat model: the same tokens as the chat completion the request stands for
(system blocks, text blocks, stop sequences, JSON schemas), an assistant message at the end
continued (Anthropic's prefill), stop reasons and the prompt's cache split in ``usage``,
Anthropic's streamed events, Anthropic's own client reading both, its ``x-api-key``, and what is
not served refused by name in Anthropic's error shape."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest
from base_model_server import (  # noqa: F401 (pytest fixtures: http, server)
    MODEL,
    assert_openai_error,
    http_fixture,
    server_fixture,
    wait_until_idle,
)
from loraserve.api import ServerThread

from loraserve.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
ASK = [{"role": "user", "content": QUESTION}]


def _chat(http: httpx.Client, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    response = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "temperature": 0, **fields}
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def _message(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": ASK, **fields}
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def _anthropic_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return dict(body["error"])


def test_a_message_is_the_chat_completion_it_stands_for(http: httpx.Client) -> None:
    system = [{"type": "text", "text": "Answer in one "}, {"type": "text", "text": "short sentence."}]
    blocks = [
        {"type": "text", "text": "Hello."},
        {"type": "thinking", "thinking": "x"},
        {"type": "text"},  # skipped, as vLLM's
        {"type": "text", "text": QUESTION},
    ]
    message = _message(http, system=system, messages=[{"role": "user", "content": blocks}], watermarking=False)
    chat = _chat(http, [{"role": "system", "content": "Answer in one short sentence."},
                        {"role": "user", "content": "Hello.\n" + QUESTION}], max_tokens=12)  # fmt: skip
    assert message["id"].startswith("msg_") and message["type"] == "message" and message["role"] == "assistant"
    assert message["model"] == MODEL and message["content"] == [
        {"type": "text", "text": chat["choices"][0]["message"]["content"]}
    ]
    assert message["stop_reason"] == {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
    usage = message["usage"]
    prompt = chat["usage"]["prompt_tokens"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] == prompt
    assert usage["output_tokens"] == chat["usage"]["completion_tokens"]
    again = _message(http, system=system, messages=[{"role": "user", "content": blocks}])
    assert again["content"] == message["content"] and again["usage"]["cache_read_input_tokens"] > 0  # the prefix cache


def test_stop_reasons_prefill_and_json_schema(http: httpx.Client) -> None:
    short = _message(http, max_tokens=2)
    assert (
        short["stop_reason"] == "max_tokens" and short["usage"]["output_tokens"] == 2 and short["stop_sequence"] is None
    )
    text = _message(http, max_tokens=20)["content"][0]["text"]
    stop = text.split()[2]  # a word inside the greedy answer ends it early
    stopped = _message(http, max_tokens=20, stop_sequences=[stop])
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == stop
    assert stopped["content"][0]["text"] == text[: text.index(stop)]
    prefill = [*ASK, {"role": "assistant", "content": "The capital"}]  # Anthropic's prefill: continued
    continued = _message(http, messages=prefill)["content"][0]["text"]
    chat = _chat(http, prefill, max_tokens=12, add_generation_prompt=False, continue_final_message=True)
    assert continued == chat["choices"][0]["message"]["content"]
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    shaped = _message(http, max_tokens=40, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert set(json.loads(shaped["content"][0]["text"])) == {"city"}


def test_streamed_events_carry_the_same_text(http: httpx.Client) -> None:
    whole = _message(http)
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": ASK, "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert stream.status_code == 200
    kinds = [line[7:] for line in lines[::2]]
    events = [json.loads(line[6:]) for line in lines[1::2]]
    assert all(line.startswith("event: ") for line in lines[::2]) and [e["type"] for e in events] == kinds
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0]["message"]["content"] == [] and events[0]["message"]["id"].startswith("msg_")
    text = "".join(e["delta"]["text"] for e in events[2:-3])
    assert text == whole["content"][0]["text"]
    assert events[-2]["delta"] == {"stop_reason": whole["stop_reason"], "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    stop = whole["content"][0]["text"].split()[1]
    with http.stream("POST", "/v1/messages", json={**body, "stop_sequences": [stop]}) as stream:
        data = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
    assert data[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    text = "".join(e["delta"]["text"] for e in data if e["type"] == "content_block_delta")
    assert text == whole["content"][0]["text"][: whole["content"][0]["text"].index(stop)]  # held back, then cut


def test_anthropic_client_reads_both(server: tuple[ServerThread, LLMEngine]) -> None:
    running, _ = server
    client = anthropic.Anthropic(base_url=running.url, api_key="unused", max_retries=0)
    message = client.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body={"temperature": 0})  # type: ignore[arg-type]
    assert message.content[0].type == "text" and message.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(model=MODEL, max_tokens=8, messages=ASK, extra_body={"temperature": 0}) as stream:  # type: ignore[arg-type]
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text == final.content[0].text  # type: ignore[union-attr]
    counted = client.messages.count_tokens(model=MODEL, messages=ASK)  # type: ignore[arg-type]
    chat = httpx.post(running.url + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 1})
    assert (
        counted.input_tokens
        == chat.json()["usage"]["prompt_tokens"]
        == message.usage.input_tokens
        + ((message.usage.cache_read_input_tokens or 0) + (message.usage.cache_creation_input_tokens or 0))
    )


def test_what_is_not_served_is_refused_in_anthropics_shape(
    http: httpx.Client, server: tuple[ServerThread, LLMEngine]
) -> None:
    base = {"model": MODEL, "max_tokens": 8, "messages": ASK}
    tool = {"name": "f", "input_schema": {"type": "object"}}
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"model": "no-such-model"}, 404, "no-such-model"),
        ({"tools": [tool]}, 400, "tools are not supported"),
        ({"tool_choice": {"type": "any"}}, 400, "tool_choice 'any'"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2000}, 400, "thinking 'enabled'"),
        ({"thinking": {"type": "adaptive", "display": "omitted"}}, 400, "thinking.display"),
        ({"watermarking": True}, 400, "['watermarking']"),
        ({"messages": [*ASK, use]}, 400, "messages.1.content.0: content blocks of type 'tool_use'"),
        ({"vllm_xargs": {"a": 1}}, 400, "['vllm_xargs']"),
        ({"messages": []}, 400, "at least one message"),
        ({"temperature": -1}, 400, "temperature"),
        ({"output_config": {"format": {"schema": {"type": "wrong"}}}}, 400, "output_config.format.schema"),
    ]  # fmt: skip
    for fields, status, message in cases:
        error = _anthropic_error(http.post("/v1/messages", json={**base, **fields}), status)
        assert message in error["message"], (fields, error)
    counting = {"model": MODEL, "messages": ASK, "tools": [tool]}
    count = _anthropic_error(http.post("/v1/messages/count_tokens", json=counting), 400)
    assert "tools" in count["message"]
    # A body that does not validate gets the API's usual error, as vLLM's.
    for fields in ({"max_tokens": 0}, {"messages": [{"role": "user", "content": [{"type": "document"}]}]}):
        assert_openai_error(http.post("/v1/messages", json={**base, **fields}), 400)
    assert (
        "max_tokens"
        in assert_openai_error(http.post("/v1/messages", json={"model": MODEL, "messages": ASK}), 400)["param"]
    )
    budget = {**base, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert "less than max_tokens" in assert_openai_error(http.post("/v1/messages", json=budget), 400)["message"]
    wait_until_idle(http, server[1])  # nothing left running


def test_an_inline_system_message_keeps_its_place_for_a_template_that_takes_it(http: httpx.Client) -> None:
    """SmolLM2's template takes system messages anywhere, so one among the turns stays there (its
    blocks joined with nothing between), as the prompt's token count shows."""
    reminder = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    turns = [{"role": "user", "content": "Hi"}, {"role": "system", "content": reminder}, ASK[0]]
    counted = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": turns})
    assert counted.status_code == 200, counted.text
    chat = [turns[0], {"role": "system", "content": "Be brief."}, ASK[0]]
    tokenized = http.post("/tokenize", json={"model": MODEL, "messages": chat})
    assert tokenized.status_code == 200, tokenized.text
    assert counted.json()["input_tokens"] == tokenized.json()["count"]
    merged = [{"role": "system", "content": "Be brief."}, turns[0], ASK[0]]  # what a merge would have sent
    merged_count = http.post("/tokenize", json={"model": MODEL, "messages": merged}).json()["count"]
    assert merged_count != tokenized.json()["count"]  # (the template adds its default system prompt before a user)
