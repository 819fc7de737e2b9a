"""The HTTP API on the base model: usage stats, special tokens, /tokenize and /detokenize as vLLM
serves them, /metrics, and cancellation when a client disconnects."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from base_model_server import (  # noqa: F401 (pytest fixtures: client, http, server)
    MODEL,
    PROMPT,
    assert_openai_error,
    client_fixture,
    http_fixture,
    metric_values,
    server_fixture,
    wait_until_idle,
)
from loraserve.api import ServerThread

from loraserve.llm_engine import LLMEngine

pytestmark = pytest.mark.slow


def test_continuous_usage_stats_and_special_tokens(client: openai.OpenAI, server: tuple[Any, LLMEngine]) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options=options,  # type: ignore[arg-type]
    )
    chunks = list(stream)
    counts = [chunk.usage.completion_tokens for chunk in chunks if chunk.choices and chunk.usage]
    assert counts and counts == sorted(counts) and counts[-1] == 5  # usage so far, in every chunk
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    for kind in ("chat", "completion"):  # with n = 2, each chunk counts its own choice's tokens (vLLM's)
        common: dict[str, Any] = dict(model=MODEL, max_tokens=4, temperature=1.0, seed=1, n=2, stream=True)
        common["stream_options"] = options
        if kind == "chat":
            chat = list(client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **common))
            per_choice = [(c.choices[0].index, c.usage.completion_tokens) for c in chat if c.choices and c.usage]
            opening = [c.usage for c in chat[:2] if c.choices[0].delta.role]  # vLLM's: the prompt counted
            assert len(opening) == 2 and all(u and u.prompt_tokens > 0 and u.completion_tokens == 0 for u in opening)
        else:
            plain = client.completions.create(prompt=PROMPT, extra_body={"ignore_eos": True}, **common)
            per_choice = [(c.choices[0].index, c.usage.completion_tokens) for c in plain if c.choices and c.usage]
        for index in (0, 1):
            counts = [count for i, count in per_choice if i == index]
            assert counts and counts == sorted(counts) and counts[-1] <= 4, (kind, per_choice)
            assert counts[0] <= 1 and len(counts) == len(set(counts)), (kind, per_choice)
    eos = min(server[1].scheduler.stop_checker.eos_token_ids)
    forced = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={str(eos): 100})
    extra = {"ignore_eos": True}
    hidden = client.completions.create(**forced, extra_body=extra).choices[0].text  # type: ignore[call-overload]
    shown = client.completions.create(**forced, extra_body={**extra, "skip_special_tokens": False}).choices[0].text  # type: ignore[call-overload]
    assert hidden == "" and shown == server[1].tokenizer.decode([eos]) * 3


def test_tokenize_and_detokenize_as_vllm(http: httpx.Client, server: tuple[Any, LLMEngine]) -> None:
    engine = server[1]
    expected = list(engine.tokenizer.encode(PROMPT))
    body = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == engine.max_model_len and len(body["token_strs"]) == len(expected)
    plain = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["token_strs"] is None and plain["tokens"] == list(
        engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    )
    messages = [{"role": "user", "content": "Say hi"}]
    chat = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == list(engine.tokenizer.encode(text, add_special_tokens=False))
    back = http.post("/detokenize", json={"model": MODEL, "tokens": plain["tokens"]}).json()
    assert back == {"prompt": engine.tokenizer.decode(plain["tokens"])} and PROMPT in back["prompt"]
    assert_openai_error(http.post("/detokenize", json={"tokens": [10**9]}), 400)
    assert_openai_error(http.post("/tokenize", json={"model": MODEL}), 400)  # neither prompt nor messages
    assert_openai_error(http.post("/tokenize", json={"model": "no-such", "prompt": "x"}), 404)


def test_long_prompts_through_the_tokenizing_thread(http: httpx.Client, server: tuple[Any, LLMEngine]) -> None:
    """Prompts past ``INLINE_CHARS`` take the tokenizing thread: /tokenize (text, chat) and a
    completion's prompts give the tokenizer's ids, special tokens as asked; a too-long prompt is a 400."""
    tokenizer = server[1].tokenizer
    long = "Once upon a time, in a land far away, " * 500  # 19,000 characters
    for special in (True, False):
        body = http.post("/tokenize", json={"prompt": long, "add_special_tokens": special}).json()
        assert body["tokens"] == list(tokenizer.encode(long, add_special_tokens=special))
    messages = [{"role": "user", "content": long}]
    chat = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == list(tokenizer.encode(text, add_special_tokens=False))
    prompts = [long[:4_500], "Hi", long[:4_600], long[:4_700], long[:4_800]]  # long together: on the thread
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 1}).json()
    assert reply["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(prompt)) for prompt in prompts)
    assert sorted(choice["index"] for choice in reply["choices"]) == list(range(len(prompts)))
    too_long = http.post("/v1/completions", json={"model": MODEL, "prompt": long * 10, "max_tokens": 1})
    assert_openai_error(too_long, 400)


def test_metrics_parse(http: httpx.Client, client: openai.OpenAI, server: tuple[Any, LLMEngine]) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    values = wait_until_idle(http, server[1])
    assert values[("loraserve_pool_pages", (("kind", "total"),))] == server[1].pool.num_pages
    for kind in ("kv", "adapter", "prefix_cache"):
        assert ("loraserve_pool_pages", (("kind", kind),)) in values
    assert values[("loraserve_generation_tokens_total", (("model", MODEL),))] >= 3
    assert values[("loraserve_time_to_first_token_seconds_count", (("model", MODEL),))] >= 1
    assert values[("loraserve_inter_token_latency_seconds_count", (("model", MODEL),))] >= 2
    assert values[("loraserve_request_success_total", (("finish_reason", "length"), ("model", MODEL)))] >= 1
    for name in ("loraserve_preemptions_total", "loraserve_adapter_loads_total", "loraserve_adapter_evictions_total"):
        assert (name, ()) in values
    assert ("loraserve_prefix_cache_hits_total", (("model", MODEL),)) in values


def test_stream_disconnect_frees_all_pages(http: httpx.Client, server: tuple[Any, LLMEngine]) -> None:
    engine = server[1]
    before = metric_values(http)[("loraserve_generation_tokens_total", (("model", MODEL),))]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks: list[dict[str, Any]] = []
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(json.loads(line[len("data: ") :]))
                if len(chunks) == 2:
                    break  # leaving the block closes the connection mid-stream
    assert chunks[0]["choices"][0]["text"]
    values = wait_until_idle(http, engine, timeout=20)
    assert values[("loraserve_generation_tokens_total", (("model", MODEL),))] - before < 400
    assert engine.pool.num_free_pages + engine.pool.num_evictable_pages == engine.pool.num_pages


def test_non_stream_disconnect_aborts(server: tuple[ServerThread, LLMEngine], http: httpx.Client) -> None:
    url = server[0].url
    before = metric_values(http)[("loraserve_generation_tokens_total", (("model", MODEL),))]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=1.0))
    values = wait_until_idle(http, server[1], timeout=20)
    assert values[("loraserve_generation_tokens_total", (("model", MODEL),))] - before < 400


def test_a_stream_left_before_its_first_byte_is_aborted(
    server: tuple[ServerThread, LLMEngine], http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client sends a streamed request and leaves before the engine has even accepted it (a
    busy engine thread; here: slow to accept it): the request is aborted all the same, instead of
    running to max_tokens for nobody."""
    engine = server[1]
    aborted = threading.Event()
    abort, add = engine.abort_request, engine.add_request

    def recording_abort(request_id: str) -> None:
        aborted.set()
        abort(request_id)

    def slow_add(*args: Any, **kwargs: Any) -> None:
        time.sleep(1.0)  # the client has left before its request is accepted
        add(*args, **kwargs)

    monkeypatch.setattr(engine, "abort_request", recording_abort)
    monkeypatch.setattr(engine, "add_request", slow_add)
    before = metric_values(http)[("loraserve_generation_tokens_total", (("model", MODEL),))]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    payload = json.dumps(body).encode()
    url = httpx.URL(server[0].url)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((url.host, url.port)) as connection:
        connection.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    assert aborted.wait(30), "the request ran on after its client left"
    values = wait_until_idle(http, engine, timeout=20)
    assert values[("loraserve_generation_tokens_total", (("model", MODEL),))] - before < 400
