"""``/v1/responses`` (OpenAI's Responses API) as vLLM 0.32 serves it for a chat model: the same
tokens as the chat completion it stands for (instructions, input messages, continued assistant
messages, logprobs, JSON schemas), vLLM's echo of the settings, ``incomplete`` on running out of
tokens, vLLM's streamed event sequence, OpenAI's own client and types reading both, and what it
does not serve refused by name."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from base_model_server import (  # noqa: F401 (pytest fixtures: client, http, server)
    MODEL,
    assert_openai_error,
    client_fixture,
    http_fixture,
    metric_values,
    server_fixture,
    wait_until_idle,
)
from openai.types.responses import Response

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
INSTRUCTIONS = "Answer in one short sentence."


def _chat(http: httpx.Client, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **fields})
    assert response.status_code == 200, response.text
    return dict(response.json())


def _respond(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    response = http.post("/v1/responses", json={"model": MODEL, **fields})
    assert response.status_code == 200, response.text
    body = dict(response.json())
    Response.model_validate(body)  # OpenAI's own type, validated (not only constructed)
    return body


def _events(http: httpx.Client, **fields: Any) -> list[tuple[str, dict[str, Any]]]:
    """The SSE stream as (event name, data) pairs, checking the framing on the way."""
    with http.stream("POST", "/v1/responses", json={"model": MODEL, "stream": True, **fields}) as response:
        assert response.status_code == 200
        blocks = "".join(response.iter_text()).split("\n\n")
    assert blocks[-1] == ""  # every event ends with a blank line; no "data: [DONE]"
    events = []
    for block in blocks[:-1]:
        name_line, data_line = block.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        events.append((name, data))
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    return events


def test_the_answer_is_the_chat_completion_it_stands_for(http: httpx.Client) -> None:
    settings = {"temperature": 0, "max_tokens": 24}
    chat = _chat(http, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], **settings)
    body = _respond(http, input=QUESTION, instructions=INSTRUCTIONS, temperature=0, max_output_tokens=24)
    assert body["id"].startswith("resp_") and body["object"] == "response"
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["id"].startswith("msg_")
    (part,) = item["content"]
    assert part == {"type": "output_text", "text": chat["choices"][0]["message"]["content"], "annotations": [],
                    "logprobs": None}  # fmt: skip
    finished = chat["choices"][0]["finish_reason"]
    assert body["status"] == ("incomplete" if finished == "length" else "completed")
    usage = body["usage"]
    assert usage["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert usage["output_tokens"] == chat["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    # vLLM's echo: the settings as they took effect.
    assert body["max_output_tokens"] == 24 and body["temperature"] == 0.0 and body["top_p"] == 1.0
    assert body["instructions"] == INSTRUCTIONS and body["model"] == MODEL
    assert body["tool_choice"] == "none" and body["tools"] == [] and body["text"] is None
    assert body["top_logprobs"] is None and body["truncation"] == "disabled" and body["incomplete_details"] is None


def test_running_out_of_tokens_is_incomplete_and_the_request_id_names_it(http: httpx.Client) -> None:
    body = _respond(http, input=QUESTION, max_output_tokens=3, ignore_eos=True, temperature=0, request_id="resp_mine")
    assert body["id"] == "resp_mine"
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 3
    assert body["output"][0]["status"] == "completed"  # vLLM's: the message item itself is complete


def test_input_messages_parts_and_a_continued_assistant_message(http: httpx.Client) -> None:
    settings = {"temperature": 0, "max_tokens": 12}
    parts = [{"type": "input_text", "text": "Name a colour."}, {"type": "input_text", "text": "One word."}]
    body = _respond(http, input=[{"role": "user", "content": parts}], temperature=0, max_output_tokens=12)
    chat = _chat(http, [{"role": "user", "content": "Name a colour.\nOne word."}], **settings)
    assert body["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    started = "The capital of France is"
    history = [
        {"type": "message", "role": "user", "content": QUESTION},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": started}],
         "status": "incomplete"},
    ]  # fmt: skip
    body = _respond(http, input=history, temperature=0, max_output_tokens=12)
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": started}]
    chat = _chat(http, messages, continue_final_message=True, add_generation_prompt=False, **settings)
    assert body["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]


def test_logprobs_when_included(http: httpx.Client) -> None:
    body = _respond(
        http,
        input=QUESTION,
        temperature=0,
        max_output_tokens=6,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    chat = _chat(
        http, [{"role": "user", "content": QUESTION}], temperature=0, max_tokens=6, logprobs=True, top_logprobs=2
    )
    logprobs = body["output"][0]["content"][0]["logprobs"]
    expected = chat["choices"][0]["logprobs"]["content"]

    def pairs(entries: list[dict[str, Any]]) -> list[tuple[str, float]]:
        return [(e["token"], e["logprob"]) for e in entries]

    assert pairs(logprobs) == pairs(expected) and body["top_logprobs"] == 2
    assert [pairs(e["top_logprobs"]) for e in logprobs] == [pairs(e["top_logprobs"]) for e in expected]
    assert all(len(e["top_logprobs"]) == 2 for e in logprobs)


def test_streamed_events_in_vllms_order(http: httpx.Client) -> None:
    whole = _respond(
        http, input=QUESTION, temperature=0, max_output_tokens=16, include=["message.output_text.logprobs"]
    )
    events = _events(
        http, input=QUESTION, temperature=0, max_output_tokens=16, include=["message.output_text.logprobs"]
    )
    names = [name for name, _ in events]
    opening = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    closing = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert names[:4] == opening and names[-4:] == [*closing, "response.completed"]
    deltas = [data for name, data in events[4:-4]]
    assert deltas and all(data["type"] == "response.output_text.delta" for data in deltas)
    text = whole["output"][0]["content"][0]["text"]
    assert "".join(data["delta"] for data in deltas) == text
    # Each delta carries its tokens' logprobs (without bytes); EOS, whose text is not in the output,
    # reaches no delta; the finished part holds them all, as the whole response does.
    streamed = [(e["token"], e["logprob"]) for data in deltas for e in data["logprobs"]]
    tokens = [(e["token"], e["logprob"]) for e in whole["output"][0]["content"][0]["logprobs"]]
    assert streamed == tokens[: len(streamed)] and len(tokens) - len(streamed) <= 1
    assert all("bytes" not in e for data in deltas for e in data["logprobs"])
    assert events[-3][1]["part"]["logprobs"] == whole["output"][0]["content"][0]["logprobs"]
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    completed = events[-1][1]["response"]
    Response.model_validate(completed)
    assert completed["output"][0]["content"][0]["text"] == text and completed["id"] == events[0][1]["response"]["id"]
    assert completed["output"][0]["id"] == deltas[0]["item_id"]
    counts = ("input_tokens", "output_tokens", "total_tokens")  # the cache's share depends on what ran before
    assert [completed["usage"][name] for name in counts] == [whole["usage"][name] for name in counts]
    assert events[-4][1]["text"] == text


def test_openai_client_reads_whole_and_streamed_responses(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=12)
    assert whole.output_text and whole.status in ("completed", "incomplete")
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=12) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and kinds[-1] == "response.completed"


def test_json_schema_text_format(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    text = {"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}}
    body = _respond(http, input=QUESTION + " JSON.", temperature=0, max_output_tokens=30, text=text)
    assert json.loads(body["output"][0]["content"][0]["text"])["city"] in ("Paris", "Lyon")
    assert body["text"]["format"]["name"] == "city"
    body = _respond(http, input=QUESTION + " JSON.", temperature=0, max_output_tokens=30,
                    text={"format": {"type": "json_object"}})  # fmt: skip
    if body["status"] == "completed":
        assert isinstance(json.loads(body["output"][0]["content"][0]["text"]), dict)
    bad = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}
    error = assert_openai_error(http.post("/v1/responses", json={"model": MODEL, "input": "x", "text": bad}), 400)
    assert error["param"] == "text" and "text.format" in error["message"]
    nameless = {"format": {"type": "json_schema", "schema": schema}}
    error = assert_openai_error(http.post("/v1/responses", json={"model": MODEL, "input": "x", "text": nameless}), 400)
    assert error["param"] == "text" and "name" in error["message"]


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, 400, "tools"),
        ({"background": True}, 400, "background"),
        ({"previous_response_id": "resp_gone"}, 404, "response_id"),
        ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
        ({"truncation": "auto"}, 400, "truncation"),
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, 400, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input.0.content.0",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, 400, "input.0.role"),
        ({"input": []}, 400, "input"),
        ({"model": "no-such-model"}, 404, "model"),
        ({"max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"include": ["everything"]}, 400, "include.0"),
        ({"tool_choice": "sometimes"}, 400, "tool_choice"),
        ({"vllm_xargs": {"a": 1}}, 400, "vllm_xargs"),
        ({"enable_response_messages": True}, 400, "enable_response_messages"),
        (
            {"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}},
            400,
            "structured_outputs",
        ),
    ],
)
def test_what_it_does_not_serve_is_refused_by_name(
    http: httpx.Client, fields: dict[str, Any], status: int, param: str
) -> None:
    response = http.post("/v1/responses", json={"model": MODEL, "input": QUESTION, **fields})
    assert assert_openai_error(response, status)["param"].startswith(param)  # a union names its member after


def test_nothing_is_stored_to_retrieve_or_cancel(http: httpx.Client) -> None:
    body = _respond(http, input=QUESTION, max_output_tokens=2, store=True)
    for response in (http.get(f"/v1/responses/{body['id']}"), http.post(f"/v1/responses/{body['id']}/cancel")):
        error = assert_openai_error(response, 404)
        assert error["message"] == f"Response with id '{body['id']}' not found." and error["param"] == "response_id"


def test_streamed_stops_and_running_out_of_tokens(http: httpx.Client) -> None:
    """Held-back text around a stop string still adds up to the whole answer; a stream that runs
    out of tokens ends with ``response.completed`` holding the incomplete response (vLLM's)."""
    fields = {"input": QUESTION, "temperature": 0, "max_output_tokens": 24, "stop": [" Paris", "."]}
    whole = _respond(http, **fields)
    events = _events(http, **fields)
    deltas = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert deltas == whole["output"][0]["content"][0]["text"] and "." not in deltas
    events = _events(http, input=QUESTION, max_output_tokens=4, ignore_eos=True, temperature=0)
    name, data = events[-1]
    assert name == "response.completed" and data["response"]["status"] == "incomplete"
    assert data["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["response"]["usage"]["output_tokens"] == 4


def _generated(http: httpx.Client) -> float:
    values = metric_values(http)
    return sum(v for (name, _), v in values.items() if name == "loraserve_generation_tokens_total")


def test_a_client_leaving_a_stream_ends_its_request(http: httpx.Client, server: tuple[Any, Any]) -> None:
    """Closing the connection after the first event aborts the engine request (far fewer than its
    400 tokens are generated by the time the engine is idle) and frees its in-flight slot."""
    before = _generated(http)
    body = {"model": MODEL, "input": QUESTION, "stream": True, "max_output_tokens": 400, "ignore_eos": True}
    with http.stream("POST", "/v1/responses", json=body) as response:
        assert next(response.iter_lines()).startswith("event: response.created")
    wait_until_idle(http, server[1])
    assert _generated(http) - before < 400
    assert _respond(http, input=QUESTION, max_output_tokens=2)["usage"]["output_tokens"] <= 2
