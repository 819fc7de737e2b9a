"""The HTTP API on the base model: chat completions (streamed and not), vLLM's extra fields, and
what the chat template is given (message names, template kwargs, tool calls of the history)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from base_model_server import (  # noqa: F401 (pytest fixtures: client, http, server)
    MODEL,
    PROMPT_TOKEN,
    USER_HI,
    assert_openai_error,
    client_fixture,
    http_fixture,
    server_fixture,
)

from loraserve.llm_engine import LLMEngine

pytestmark = pytest.mark.slow


def test_chat_stream_and_non_stream(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content and full.usage is not None and full.usage.completion_tokens <= 5
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=2,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert len(tokens) == full.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in tokens)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    kwargs: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 3, "n": 2, "seed": 3}
    pair = client.chat.completions.create(**kwargs)
    assert [choice.index for choice in pair.choices] == [0, 1]
    streamed = ["", ""]
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [choice.message.content for choice in pair.choices]


def test_stream_chunks_shaped_as_vllm_sends_them(http: httpx.Client) -> None:
    """One first chunk per choice with the role; after it, deltas without ``role`` (no null fields),
    and ``{"content": ""}`` for a chunk that only ends its choice."""
    body = {"model": MODEL, "messages": [USER_HI], "max_tokens": 3, "n": 2, "seed": 1, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    first = [{"index": i, "delta": {"role": "assistant", "content": ""}} for i in (0, 1)]
    assert [{key: c["choices"][0][key] for key in ("index", "delta")} for c in chunks[:2]] == first
    assert all(len(c["choices"]) == 1 for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks[2:]]
    assert deltas and all(set(delta) == {"content"} for delta in deltas)
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]) == [0, 1]
    body = {"model": MODEL, "messages": [USER_HI], "max_tokens": 64, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    last = json.loads(lines[-2])["choices"][0]  # ended by the end-of-turn token, whose text is not sent
    assert last["finish_reason"] == "stop" and last["delta"] == {"content": ""}


def test_null_max_tokens_stream_options_and_chat_stop_reason_as_vllm(
    http: httpx.Client, server: tuple[Any, LLMEngine]
) -> None:
    """``max_tokens: null`` on completions means the default, 16, as not sent (vLLM 0.32's
    ``normalize_null_max_tokens``); on chat, as many as fit;
    ``stream_options`` without ``stream`` is refused; a streamed chat's last chunk names the stop
    string that ended it (``stop_reason``), and only the last names one, as vLLM's do."""
    engine = server[1]
    context = min(engine.max_model_len, engine.max_seq_tokens)  # the pool's, here
    too_big = {"model": MODEL, "prompt": [PROMPT_TOKEN] * (engine.max_seq_tokens + 1), "max_tokens": 1}
    assert "raise num_pages" in assert_openai_error(http.post("/v1/completions", json=too_big), 400)["message"]
    prompt = [PROMPT_TOKEN] * (context - 20)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": None, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16
    chat = {"model": MODEL, "messages": [USER_HI], "max_tokens": None, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/chat/completions", json=chat)
    assert response.status_code == 200, response.text
    used = response.json()["usage"]
    assert used["prompt_tokens"] + used["completion_tokens"] == context  # all that fit
    unasked = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "ignore_eos": True})
    assert unasked.json()["usage"]["completion_tokens"] == 16  # not sent: the default, 16
    for route, field in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [USER_HI]})):
        body = {"model": MODEL, "max_tokens": 2, "stream_options": {"include_usage": True}, **field}
        assert assert_openai_error(http.post(route, json=body), 400)["param"] == "stream_options"
    question = {"role": "user", "content": "What is the capital of France?"}
    body = {"model": MODEL, "messages": [question], "max_tokens": 20, "temperature": 0, "stop": ["Paris"]}
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["stop_reason"] == "Paris", plain
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    finals = [choice for event in events for choice in event["choices"] if choice["finish_reason"]]
    assert [(c["finish_reason"], c["stop_reason"]) for c in finals] == [("stop", "Paris")]
    assert all("stop_reason" not in choice for e in events for choice in e["choices"] if not choice["finish_reason"])


def test_vllm_fields_are_honoured_or_refused(http: httpx.Client) -> None:
    """vLLM's request fields that change the prompt or the output: a chat's last message continued
    (``continue_final_message``) equals completing the rendered text; the others are refused with a
    400 naming them, never silently ignored."""
    from transformers import AutoTokenizer

    from loraserve.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    chat = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "It is"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("It is")
    greedy = {"model": MODEL, "max_tokens": 4, "temperature": 0}
    body = {**greedy, "messages": chat, "add_generation_prompt": False, "continue_final_message": True}
    continued = http.post("/v1/chat/completions", json=body).json()
    completed = http.post("/v1/completions", json={**greedy, "prompt": tokenizer.encode(text)}).json()
    assert continued["choices"][0]["message"]["content"] == completed["choices"][0]["text"]
    assert continued["usage"]["prompt_tokens"] == completed["usage"]["prompt_tokens"]
    both = {**body, "add_generation_prompt": True}
    assert assert_openai_error(http.post("/v1/chat/completions", json=both), 400)["param"] == "continue_final_message"
    refused_everywhere: dict[str, Any] = {
        "response_format": {"type": "structural_tag"},  # json_object, json_schema: test_api_structured_outputs.py
        "structured_outputs": {"structural_tag": "{}"},
        "logits_processors": ["x"],
        "return_tokens_as_token_ids": True,
        "priority": 1,
    }
    for route, field, only_here in (
        ("/v1/completions", {"prompt": "x"}, {"prompt_embeds": "AAAA"}),
        ("/v1/chat/completions", {"messages": [USER_HI]}, {"chat_template": "{{ 1 }}", "documents": []}),
    ):
        for name, value in {**refused_everywhere, **only_here}.items():
            response = http.post(route, json={"model": MODEL, "max_tokens": 2, **field, name: value})
            assert assert_openai_error(response, 400)["param"] == name, (route, name)
        text_format = {"model": MODEL, "max_tokens": 2, **field, "response_format": {"type": "text"}}
        plain_text = http.post(route, json=text_format)
        assert plain_text.status_code == 200, plain_text.text


def test_chat_template_gets_message_names_and_template_kwargs() -> None:
    """The template sees each message's ``name`` and the request's ``chat_template_kwargs`` (vLLM's
    template variables); a template that fails on them is a 400, not a 500."""
    from types import SimpleNamespace

    from loraserve.api.chat_template import render_chat_text
    from loraserve.api.errors import APIError
    from loraserve.api.openai_protocol import ChatMessage
    from transformers import AutoTokenizer

    from loraserve.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    messages = "{% for m in messages %}[{{ m.get('name', '-') }}] {{ m['content'] }}{% endfor %}"
    tokenizer.chat_template = "{{ greeting }}" + messages
    state: Any = SimpleNamespace(tokenizer=tokenizer)
    chat = [ChatMessage(role="user", content="hi", name="bob"), ChatMessage(role="user", content="yo")]
    text = render_chat_text(state, chat, add_generation_prompt=True, template_kwargs={"greeting": "Hello! "})
    assert text == "Hello! [bob] hi[-] yo"
    assert render_chat_text(state, chat, add_generation_prompt=True) == "[bob] hi[-] yo"
    for key in ("chat_template", "tools", "documents", "tokenize"):  # the call's options, not variables
        with pytest.raises(APIError, match=key):
            render_chat_text(state, chat, add_generation_prompt=True, template_kwargs={key: "x"})
    tokenizer.chat_template = "{{ raise_exception('no ' + greeting) }}"
    with pytest.raises(APIError, match="no thanks"):
        render_chat_text(state, chat, add_generation_prompt=True, template_kwargs={"greeting": "thanks"})


def test_chat_template_gets_tool_calls_of_the_history() -> None:
    """An assistant message's ``tool_calls`` (arguments parsed from JSON, as vLLM hands them to
    templates) and a tool message's ``tool_call_id`` reach the template; bad ones are 400s."""
    from types import SimpleNamespace

    from loraserve.api.chat_template import render_chat_text
    from loraserve.api.errors import APIError
    from loraserve.api.openai_protocol import ChatMessage
    from transformers import AutoTokenizer

    from loraserve.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %}<{{ c['id'] }} {{ c['function']['name'] }}"
        "({{ c['function']['arguments']['city'] }})>{% endfor %}"
        "{% if m.get('tool_call_id') %}[{{ m['tool_call_id'] }}]{% endif %};{% endfor %}"
    )
    state: Any = SimpleNamespace(tokenizer=tokenizer)
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    chat = [
        ChatMessage(role="user", content="weather?"),
        ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [call]}),
        ChatMessage(role="tool", content="sunny", tool_call_id="c1"),
    ]
    text = render_chat_text(state, chat, add_generation_prompt=False)
    assert text == "user:weather?;assistant:<c1 weather(Paris)>;tool:sunny[c1];"
    as_object = {**call, "function": {"name": "weather", "arguments": {"city": "Rome"}}}
    chat[1] = ChatMessage.model_validate({"role": "assistant", "tool_calls": [as_object]})
    assert "weather(Rome)" in render_chat_text(state, chat, add_generation_prompt=False)
    chat[1] = ChatMessage.model_validate(
        {"role": "assistant", "tool_calls": [{"id": "c2", "function": {"name": "now"}}]}
    )
    assert "<c2 now()>" in render_chat_text(state, chat, add_generation_prompt=False)
    where = "messages.1.tool_calls.0.function.arguments"
    for arguments, problem in (
        ("{city: Paris", "is not JSON"),
        ("1" * 5000, "is not JSON"),
        ("[1]", "not a JSON object"),
    ):
        broken = {**call, "function": {"name": "weather", "arguments": arguments}}
        chat[1] = ChatMessage.model_validate({"role": "assistant", "tool_calls": [broken]})
        with pytest.raises(APIError, match=problem) as refused:
            render_chat_text(state, chat, add_generation_prompt=False)
        assert refused.value.param == where
    chat[1] = ChatMessage.model_validate({"role": "user", "content": "x", "tool_calls": [call]})
    with pytest.raises(APIError, match="only assistant messages have tool_calls") as refused:
        render_chat_text(state, chat, add_generation_prompt=False)
    assert refused.value.param == "messages.1.tool_calls"
    chat[1] = ChatMessage(role="user", content="x", tool_call_id="c1")
    with pytest.raises(APIError, match="only tool messages have a tool_call_id") as refused:
        render_chat_text(state, chat, add_generation_prompt=False)
    assert refused.value.param == "messages.1.tool_call_id"
