"""``POST /v1/chat/completions/batch`` (vLLM 0.32's): each conversation answered as
``/v1/chat/completions`` answers it alone, as choice ``i``, usage summed; echo, roles, logprobs and
token ids per conversation; what the route does not serve refused by name."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from base_model_server import (  # noqa: F401 (pytest fixtures: http, server)
    MODEL,
    USER_HI,
    assert_openai_error,
    http_fixture,
    server_fixture,
)

pytestmark = pytest.mark.slow

CAPITAL = {"role": "user", "content": "What is the capital of France?"}
IMAGE = {"role": "user", "content": [{"type": "image_url"}]}
PREFILL = [CAPITAL, {"role": "assistant", "content": "The capital"}]


def _post(http: httpx.Client, path: str, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    response = http.post(path, json={"model": MODEL, "temperature": 0, **body}, headers=headers)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_each_conversation_is_answered_as_alone(http: httpx.Client) -> None:
    conversations = [[USER_HI], [CAPITAL], [USER_HI, {"role": "assistant", "content": "Hello!"}, CAPITAL]]
    fields = {"max_tokens": 8, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    batch = _post(http, "/v1/chat/completions/batch", {"messages": conversations, **fields}, **{"X-Request-Id": "b1"})
    alone = [_post(http, "/v1/chat/completions", {"messages": c, **fields}) for c in conversations]
    assert batch["id"] == "chatcmpl-b1" and batch["object"] == "chat.completion" and batch["model"] == MODEL
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    for choice, single in zip(batch["choices"], alone, strict=True):
        expected = single["choices"][0]
        assert choice["message"] == expected["message"]
        assert choice["token_ids"] == expected["token_ids"] and choice["token_ids"]
        assert choice["logprobs"] == expected["logprobs"]
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
        assert (choice["finish_reason"], choice["stop_reason"]) == (expected["finish_reason"], expected["stop_reason"])
    usage = batch["usage"]
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[name] == sum(single["usage"][name] for single in alone), name


def test_roles_echo_and_budgets_are_per_conversation(http: httpx.Client) -> None:
    body = {"messages": [PREFILL, [*PREFILL[:1], {"role": "assistant", "content": "Paris"}]], "max_tokens": 4}
    continued = {**body, "add_generation_prompt": False, "continue_final_message": True, "echo": True}
    batch = _post(http, "/v1/chat/completions/batch", continued)
    for choice, conversation in zip(batch["choices"], continued["messages"], strict=True):
        alone = _post(http, "/v1/chat/completions", {**continued, "messages": conversation})["choices"][0]
        assert choice["message"] == alone["message"]
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"].startswith(conversation[-1]["content"])
    # a seed applies to every conversation alike (vLLM's: each is a request of its own with it)
    sampled = {"messages": [[CAPITAL], [CAPITAL]], "max_tokens": 12, "temperature": 1.0, "seed": 7}
    texts = [c["message"]["content"] for c in _post(http, "/v1/chat/completions/batch", sampled)["choices"]]
    assert texts[0] == texts[1]


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"n": 2, "temperature": 1.0}, "n", "Batch chat completions do not support `n > 1`"),
        ({"stream": True}, "stream", "stream is not supported"),
        ({"prompt_logprobs": 1}, "prompt_logprobs", "prompt_logprobs is not supported"),
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools is not supported"),
        ({"tools": []}, "tools", "tools is not supported"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice is not supported"),
        ({"messages": [[USER_HI], [IMAGE]]}, "messages.1.0.content", "messages.1: "),  # names the conversation
        ({"messages": []}, None, "messages"),
        ({"messages": [[USER_HI], []]}, None, "messages"),
        ({"messages": [USER_HI]}, None, "messages"),  # one conversation, not a list of them
        ({"messages": [[USER_HI]] * 257}, "messages", "at most 256 conversations"),
        ({"model": "not-served"}, None, "not-served"),
    ],
)
def test_what_is_not_served_is_refused_by_name(
    http: httpx.Client, fields: dict[str, Any], param: str | None, message: str
) -> None:
    body = {"model": MODEL, "messages": [[USER_HI]], "max_tokens": 2, **fields}
    response = http.post("/v1/chat/completions/batch", json=body)
    error = assert_openai_error(response, 404 if fields.get("model") else 400)
    assert message in error["message"], error
    if param is not None:
        assert error["param"] == param
