"""The HTTP API on the base model, through a real uvicorn server: completions (streamed and not),
logprobs, stops, sampling parameters, errors in the OpenAI shape, models, health and OpenAPI, and
every parameter of the openai client honoured or refused."""

from __future__ import annotations

import json
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
    made_of,
    server_fixture,
    token_texts,
)
from loraserve.kernels import cpu, cpu_features

from loraserve.llm_engine import LLMEngine

pytestmark = pytest.mark.slow


def test_health_models_and_openapi(http: httpx.Client, client: openai.OpenAI) -> None:
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["kernels"] in ("cpu", "torch")
    if health["kernels"] == "cpu":  # the linear layers' GEMM kernels, chosen by timing or read from the cache
        gemm = health["cpu_gemm"]
        assert gemm["source"] in ("measured", "cached", "mixed") and gemm["cpu"] == cpu_features.summary()
        assert all(set(by_rows.values()) <= {"panels", "onednn", "torch"} for by_rows in gemm["layers"].values())
        metrics = http.get("/metrics").text
        for shape, by_rows in gemm["layers"].items():
            for rows, kernel in by_rows.items():
                assert f'loraserve_cpu_gemm_kernel{{kernel="{kernel}",rows="{rows}",shape="{shape}"}} 1.0' in metrics
        lora = health["cpu_lora"]  # timed per segment length or cached
        assert lora["source"] in ("measured", "cached", "disturbed") and len(lora["segment_tokens"]) == 8
        attention = health["cpu_prefill_attention"]  # the same for the prefill attention
        assert attention["source"] in ("no tiles", "measured", "cached", "disturbed")
        assert attention["kernel"] in ("amx", "vector")
        decode = health["cpu_decode_attention"]  # the decode attention's variant, timed where the build has two
        assert decode["source"] in ("only one", "measured", "cached", "disturbed")
        assert decode["kernel"] in cpu.decode_attention_variants()
        fallback = int("lora_grouped_gemm" in health.get("kernel_fallbacks", []))  # 0 with torch's MKL
        assert f'loraserve_kernel_fallback{{kernel="lora_grouped_gemm"}} {fallback}.0' in metrics
    assert [model.id for model in client.models.list()] == [MODEL]
    paths = http.get("/openapi.json").json()["paths"]
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/adapters",
        "/v1/adapters/{name}",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/health",
        "/metrics",
    ):
        assert path in paths, path
    assert "multipart/form-data" in paths["/v1/adapters"]["post"]["requestBody"]["content"]
    assert http.get("/docs").status_code == 200


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert full.object == "text_completion" and full.model == MODEL
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 6 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 6
    assert full.usage.prompt_tokens_details is not None and full.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert len({chunk.id for chunk in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6


def test_completion_prompts_n_seed_and_token_ids(client: openai.OpenAI, server: tuple[Any, LLMEngine]) -> None:
    engine = server[1]
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 1.0, "seed": 7, "n": 2}
    first = client.completions.create(prompt=[PROMPT, "Once upon a time"], **kwargs)
    assert [choice.index for choice in first.choices] == [0, 1, 2, 3]
    again = client.completions.create(prompt=[PROMPT, "Once upon a time"], **kwargs)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage is not None and first.usage.completion_tokens == 16
    ids = engine.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == engine.tokenizer.decode(ids) + by_text.choices[0].text


def test_logprobs_and_stop(client: openai.OpenAI, http: httpx.Client) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens or []) == 4
    assert "".join(logprobs.tokens or []) == result.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in (logprobs.tokens or [])[:i]) for i in range(4)]
    rows = zip(logprobs.tokens or [], logprobs.token_logprobs or [], logprobs.top_logprobs or [], strict=True)
    for token, value, top in rows:
        assert value is not None and value <= 0 and top is not None and 2 <= len(top) <= 3
        assert token in top and max(top.values()) == top[token]  # greedy picks the most likely
    stop_at = result.choices[0].text[3:6]
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stop=[stop_at])
    assert stopped.choices[0].finish_reason == "stop" and stop_at not in stopped.choices[0].text
    assert stopped.choices[0].text == result.choices[0].text[: result.choices[0].text.index(stop_at)]
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stop=[stop_at], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == stopped.choices[0].text
    for bad_ids in ([-1], [10**9]):  # echo decodes the prompt before the engine sees it: refused first
        error = assert_openai_error(
            http.post("/v1/completions", json={"model": MODEL, "prompt": bad_ids, "echo": True, "max_tokens": 1}), 400
        )
        assert "outside the vocabulary" in error["message"] and error["param"] == "prompt"


def test_a_token_with_incomplete_text_still_gets_its_chunk(client: openai.OpenAI) -> None:
    """Token 111 alone decodes to half of a UTF-8 character: forced 8 times, the stream still sends
    a chunk as the tokens come (empty text while the character is incomplete), as vLLM does."""
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={"111": 100}, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [chunk for chunk in stream if chunk.choices]
    usage_tokens = 8
    assert len(chunks) >= usage_tokens // 2  # a chunk per engine step (several only if the client lags)
    assert any(chunk.choices[0].text == "" for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_errors_use_the_openai_shape(http: httpx.Client, client: openai.OpenAI) -> None:
    error = assert_openai_error(http.post("/v1/completions", json={"model": "no-such", "prompt": "x"}), 404)
    assert error["code"] == 404 and error["type"] == "NotFoundError" and "no-such" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    error = assert_openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0}), 400)
    assert error["param"] == "n"
    assert assert_openai_error(http.post("/v1/completions", json={"model": MODEL}), 400)["param"] == "prompt"
    bad_json = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(bad_json, 400)
    refused: dict[str, Any] = {"suffix": "y", "use_beam_search": True, "guided_choice": ["a"]}
    for name, value in refused.items():
        body = {"model": MODEL, "prompt": "x", name: value}
        assert name in assert_openai_error(http.post("/v1/completions", json=body), 400)["message"]
    for bias in ({"x": 1.0}, {"10000000": 1.0}, {"5": 500.0}):
        body = {"model": MODEL, "prompt": "x", "logit_bias": bias}
        assert "logit_bias" in assert_openai_error(http.post("/v1/completions", json=body), 400)["message"]
    for name, value in (("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("min_p", 1.5), ("min_tokens", 99)):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4, name: value}
        assert name in assert_openai_error(http.post("/v1/completions", json=body), 400)["message"]
    too_long = {"model": MODEL, "prompt": "x", "max_tokens": 10**6}
    assert "max_tokens" in assert_openai_error(http.post("/v1/completions", json=too_long), 400)["message"]
    assert_openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": ""}), 400)
    assert_openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [10**9]}), 400)
    image = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert_openai_error(http.post("/v1/chat/completions", json=image), 400)
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)


def test_penalties_and_bias_are_honoured_over_http(client: openai.OpenAI) -> None:
    """vLLM's sampling parameters change the output (they are never accepted and ignored)."""
    base = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    plain = client.completions.create(**base).choices[0].text  # type: ignore[call-overload]
    extra = {"repetition_penalty": 1.8, "min_tokens": 4}
    penalized = client.completions.create(**base, presence_penalty=2.0, extra_body=extra).choices[0].text  # type: ignore[call-overload]
    assert penalized != plain
    forced = client.completions.create(**base, logit_bias={"77": 100}).choices[0]  # type: ignore[call-overload]
    assert forced.text and len(set(forced.text)) <= 2  # one token over and over


def test_prompt_logprobs_allowed_token_ids_and_bad_words_over_http(http: httpx.Client, client: openai.OpenAI) -> None:
    """vLLM's shapes: ``prompt_logprobs`` per prompt token (None first; token id -> logprob, rank,
    decoded token) in each completion choice and at the top of a chat response."""
    body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    entries = reply.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"])
    for entry in entries[1:]:
        assert 1 <= len(entry) <= 3
        ranks = sorted(item["rank"] for item in entry.values())
        assert ranks[0] >= 1 and all(item["logprob"] <= 0 and isinstance(item["decoded_token"], str)
                                     for item in entry.values())  # fmt: skip
    chat = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0},
    )
    assert chat.status_code == 200 and chat.json()["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat.json()["prompt_logprobs"][1:])  # the prompt token alone
    streamed = http.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and "prompt_logprobs" in streamed.json()["error"]["message"]
    allowed = client.completions.create(  # type: ignore[call-overload]
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"allowed_token_ids": [44, 1000]}
    )
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert made_of(allowed.choices[0].text, token_texts(http, [44, 1000]))
    assert allowed.choices[0].text != plain.choices[0].text
    first_word = plain.choices[0].text.split()[0]
    cleaned = client.completions.create(  # type: ignore[call-overload]
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"bad_words": [first_word]}
    )
    assert cleaned.choices[0].text != plain.choices[0].text
    spaced = client.completions.create(  # type: ignore[call-overload]
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"spaces_between_special_tokens": False}
    )
    assert spaced.choices[0].text == plain.choices[0].text  # a fast tokenizer: no spaces either way, as in vLLM
    bad = {"model": MODEL, "prompt": "x", "allowed_token_ids": [10**7]}
    assert "allowed_token_ids" in assert_openai_error(http.post("/v1/completions", json=bad), 400)["message"]
    only_stop = {"model": MODEL, "prompt": "x", "min_tokens": 2, "stop_token_ids": [44], "allowed_token_ids": [44]}
    as_chat = {**{k: v for k, v in only_stop.items() if k != "prompt"}, "messages": [{"role": "user", "content": "x"}]}
    for route, body in (("/v1/completions", only_stop), ("/v1/chat/completions", as_chat)):
        for stream in (False, True):
            error = assert_openai_error(http.post(route, json={**body, "stream": stream}), 400)
            assert "allowed_token_ids leaves only EOS or stop token ids" in error["message"]


# Every parameter of the openai client's create methods (openai 3.x): a value that differs from
# the default, and whether loraserve honours it ("ok") or refuses it with a 400 naming it.
COMPLETION_PARAMETERS: dict[str, tuple[Any, str]] = {
    "best_of": (2, "refused"),  # other than n
    "echo": (True, "ok"),
    "frequency_penalty": (0.5, "ok"),
    "logit_bias": ({"77": 5}, "ok"),
    "logprobs": (2, "ok"),
    "max_tokens": (3, "ok"),
    "n": (2, "ok"),
    "presence_penalty": (0.5, "ok"),
    "seed": (7, "ok"),
    "stop": (["."], "ok"),
    "stream_options": ({"include_usage": True}, "refused"),  # without stream=true, as vLLM (with it: checked elsewhere)
    "suffix": ("!", "refused"),
    "temperature": (0.7, "ok"),
    "top_p": (0.9, "ok"),
    "user": ("someone", "ok"),  # no effect on the output (as in vLLM)
}
CHAT_PARAMETERS: dict[str, tuple[Any, str]] = {
    "audio": ({"voice": "alloy", "format": "wav"}, "refused"),
    "frequency_penalty": (0.5, "ok"),
    "function_call": ("auto", "refused"),
    "functions": ([{"name": "f", "parameters": {}}], "refused"),
    "logit_bias": ({"77": 5}, "ok"),
    "logprobs": (True, "ok"),
    "max_completion_tokens": (3, "ok"),
    "max_tokens": (3, "ok"),
    "metadata": ({"k": "v"}, "ok"),  # stored-completion tags: no effect on the output
    "modalities": (["text", "audio"], "refused"),
    "moderation": (None, "ok"),  # absent from the request when None
    "n": (2, "ok"),
    "parallel_tool_calls": (False, "ok"),  # only matters with tools, which are refused
    "prediction": ({"type": "content", "content": "Paris"}, "ok"),  # a latency hint: output unchanged
    "presence_penalty": (0.5, "ok"),
    "prompt_cache_key": ("k", "ok"),  # caching is by content anyway
    "prompt_cache_options": (None, "ok"),
    "prompt_cache_retention": ("24h", "ok"),
    "reasoning_effort": ("low", "ok"),  # vLLM hands it to the chat template; SmolLM2's ignores it
    "response_format": ({"type": "json_object"}, "ok"),
    "safety_identifier": ("someone", "ok"),
    "seed": (7, "ok"),
    "service_tier": ("default", "ok"),
    "stop": (["."], "ok"),
    "store": (False, "ok"),
    "stream_options": ({"include_usage": True}, "refused"),  # without stream=true, as vLLM
    "temperature": (0.7, "ok"),
    "tool_choice": ("required", "refused"),
    "tools": ([{"type": "function", "function": {"name": "f", "parameters": {}}}], "refused"),
    "top_logprobs": (2, "ok"),  # with logprobs
    "top_p": (0.9, "ok"),
    "user": ("someone", "ok"),
    "verbosity": ("low", "ok"),
    "web_search_options": ({}, "refused"),
}


def _check_every_parameter(create: Any, table: dict[str, tuple[Any, str]], base: dict[str, Any]) -> None:
    import inspect

    transport = {"extra_headers", "extra_query", "extra_body", "timeout", "model", "prompt", "messages", "stream"}
    exposed = set(inspect.signature(create).parameters) - transport
    assert exposed == set(table), f"openai's parameters changed: {sorted(exposed ^ set(table))}"
    for name, (value, expected) in table.items():
        arguments = {**base, **({"logprobs": True} if name == "top_logprobs" else {}), name: value}
        if expected == "ok":
            reply = create(**arguments)
            assert reply.choices, name
        else:
            with pytest.raises(openai.BadRequestError, match=name):
                create(**arguments)


def test_every_openai_client_parameter_is_honoured_or_refused(client: openai.OpenAI) -> None:
    _check_every_parameter(client.completions.create, COMPLETION_PARAMETERS, {"model": MODEL, "prompt": PROMPT,
                                                                             "max_tokens": 3})  # fmt: skip
    messages = [{"role": "user", "content": "Hi"}]
    _check_every_parameter(client.chat.completions.create, CHAT_PARAMETERS, {"model": MODEL, "messages": messages,
                                                                             "max_tokens": 3})  # fmt: skip


def test_vllm_request_defaults_and_extensions(http: httpx.Client) -> None:
    """As vLLM 0.32 serves them: ``model`` may be left out (the base model), ``stream_options: {}``
    asks for no usage chunk (``include_usage`` defaults to false) and is allowed without
    ``stream``, and extensions loraserve does not implement are refused by name."""
    completion = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "temperature": 0}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        reply = http.post(path, json=body)
        assert reply.status_code == 200 and reply.json()["model"] == MODEL, reply.text
        assert http.post(path, json={**body, "stream_options": {}}).status_code == 200
        for options, usage_chunk in (({}, False), ({"include_usage": True}, True)):
            streamed = http.post(path, json={**body, "model": MODEL, "stream": True, "stream_options": options})
            events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
            assert streamed.text.rstrip().endswith("data: [DONE]")
            assert [event for event in events if event.get("usage")] == (events[-1:] if usage_chunk else [])
            assert not usage_chunk or events[-1]["usage"]["completion_tokens"] == 2
        for name, value in (("structural_tag", '{"type": "x"}'), ("best_of", 2)):
            refused = http.post(path, json={**body, name: value})
            assert refused.status_code == 400 and name in refused.json()["error"]["message"], (path, name)
