"""The HTTP API on the base model, through a real uvicorn server: completions, chat, streaming,
errors in the OpenAI shape, models, health, metrics, OpenAPI, and cancellation on disconnect."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from loraserve.api import ServerSettings, ServerThread, create_app
from loraserve.kernels import cpu, cpu_features
from prometheus_client.parser import text_string_to_metric_families

from loraserve.config import EngineConfig
from loraserve.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

MODEL = "smol"
PROMPT = "The capital of France is"
PROMPT_TOKEN = 504  # any token id of the default model's vocabulary
USER_HI = {"role": "user", "content": "Hi"}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ServerThread, LLMEngine]]:
    engine = LLMEngine(EngineConfig(num_pages=96, max_num_seqs=8, max_num_batched_tokens=512))
    with ServerThread(create_app(engine, ServerSettings(model_id=MODEL))) as running:
        yield running, engine


@pytest.fixture(scope="module")
def http(server: tuple[ServerThread, LLMEngine]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0].url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: tuple[ServerThread, LLMEngine]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metric_values(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = http.get("/metrics")
    assert response.status_code == 200
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def wait_until_idle(http: httpx.Client, engine: LLMEngine, timeout: float = 30.0) -> dict[Any, float]:
    """Poll /metrics (read on the engine thread) until nothing runs and every page is free."""
    deadline = time.monotonic() + timeout
    while True:
        values = metric_values(http)
        free = values[("loraserve_pool_pages", (("kind", "free"),))]
        cached = values[("loraserve_pool_pages", (("kind", "prefix_cache"),))]  # unreferenced, evictable
        idle = values[("loraserve_requests_running", ())] == 0 and values[("loraserve_requests_waiting", ())] == 0
        if idle and free + cached == engine.pool.num_pages:
            return values
        assert time.monotonic() < deadline, f"engine still busy: free={free} of {engine.pool.num_pages}"
        time.sleep(0.1)


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


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
        lora = health["cpu_lora"]  # float32 or a CPU without AMX: never the tiles; else timed or cached
        assert lora["source"] in ("no tiles", "measured", "cached", "disturbed") and len(lora["segment_tokens"]) == 8
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
    error = assert_openai_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}), 400
    )
    assert "echo" in error["message"]
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


def test_null_max_tokens_stream_options_and_chat_stop_reason_as_vllm(
    http: httpx.Client, server: tuple[Any, LLMEngine]
) -> None:
    """``max_tokens: null`` on completions means up to the context (not the default 16);
    ``stream_options`` without ``stream`` is refused; a streamed chat's last chunk names the stop
    string that ended it (``stop_reason``), as vLLM's do."""
    engine = server[1]
    context = min(engine.max_model_len, engine.max_seq_tokens)  # the pool's, here
    too_big = {"model": MODEL, "prompt": [PROMPT_TOKEN] * (engine.max_seq_tokens + 1), "max_tokens": 1}
    assert "raise num_pages" in assert_openai_error(http.post("/v1/completions", json=too_big), 400)["message"]
    prompt = [PROMPT_TOKEN] * (context - 20)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": None, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 20
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
    assert all(choice["stop_reason"] is None for e in events for choice in e["choices"] if not choice["finish_reason"])


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
        "response_format": {"type": "json_object"},
        "structured_outputs": {"choice": ["a", "b"]},
        "logits_processors": ["x"],
        "return_tokens_as_token_ids": True,
        "priority": 1,
    }
    for route, field, only_here in (
        ("/v1/completions", {"prompt": "x"}, {"prompt_embeds": "AAAA"}),
        ("/v1/chat/completions", {"messages": [USER_HI]}, {"chat_template": "{{ 1 }}", "echo": True, "documents": []}),
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

    from loraserve.api.errors import APIError
    from loraserve.api.openai_protocol import ChatMessage
    from loraserve.api.routes_chat import render_chat_prompt
    from transformers import AutoTokenizer

    from loraserve.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    messages = "{% for m in messages %}[{{ m.get('name', '-') }}] {{ m['content'] }}{% endfor %}"
    tokenizer.chat_template = "{{ greeting }}" + messages
    state: Any = SimpleNamespace(tokenizer=tokenizer)
    chat = [ChatMessage(role="user", content="hi", name="bob"), ChatMessage(role="user", content="yo")]
    ids = render_chat_prompt(state, chat, add_generation_prompt=True, template_kwargs={"greeting": "Hello! "})
    assert tokenizer.decode(ids) == "Hello! [bob] hi[-] yo"
    assert tokenizer.decode(render_chat_prompt(state, chat, add_generation_prompt=True)) == "[bob] hi[-] yo"
    for key in ("chat_template", "tools", "documents", "tokenize"):  # the call's options, not variables
        with pytest.raises(APIError, match=key):
            render_chat_prompt(state, chat, add_generation_prompt=True, template_kwargs={key: "x"})
    tokenizer.chat_template = "{{ raise_exception('no ' + greeting) }}"
    with pytest.raises(APIError, match="no thanks"):
        render_chat_prompt(state, chat, add_generation_prompt=True, template_kwargs={"greeting": "thanks"})


def test_chat_template_gets_tool_calls_of_the_history() -> None:
    """An assistant message's ``tool_calls`` (arguments parsed from JSON, as vLLM hands them to
    templates) and a tool message's ``tool_call_id`` reach the template; bad ones are 400s."""
    from types import SimpleNamespace

    from loraserve.api.errors import APIError
    from loraserve.api.openai_protocol import ChatMessage
    from loraserve.api.routes_chat import render_chat_prompt
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
    text = tokenizer.decode(render_chat_prompt(state, chat, add_generation_prompt=False))
    assert text == "user:weather?;assistant:<c1 weather(Paris)>;tool:sunny[c1];"
    as_object = {**call, "function": {"name": "weather", "arguments": {"city": "Rome"}}}
    chat[1] = ChatMessage.model_validate({"role": "assistant", "tool_calls": [as_object]})
    assert "weather(Rome)" in tokenizer.decode(render_chat_prompt(state, chat, add_generation_prompt=False))
    chat[1] = ChatMessage.model_validate(
        {"role": "assistant", "tool_calls": [{"id": "c2", "function": {"name": "now"}}]}
    )
    assert "<c2 now()>" in tokenizer.decode(render_chat_prompt(state, chat, add_generation_prompt=False))
    where = "messages.1.tool_calls.0.function.arguments"
    for arguments, problem in (
        ("{city: Paris", "is not JSON"),
        ("1" * 5000, "is not JSON"),
        ("[1]", "not a JSON object"),
    ):
        broken = {**call, "function": {"name": "weather", "arguments": arguments}}
        chat[1] = ChatMessage.model_validate({"role": "assistant", "tool_calls": [broken]})
        with pytest.raises(APIError, match=problem) as refused:
            render_chat_prompt(state, chat, add_generation_prompt=False)
        assert refused.value.param == where
    chat[1] = ChatMessage.model_validate({"role": "user", "content": "x", "tool_calls": [call]})
    with pytest.raises(APIError, match="only assistant messages have tool_calls") as refused:
        render_chat_prompt(state, chat, add_generation_prompt=False)
    assert refused.value.param == "messages.1.tool_calls"
    chat[1] = ChatMessage(role="user", content="x", tool_call_id="c1")
    with pytest.raises(APIError, match="only tool messages have a tool_call_id") as refused:
        render_chat_prompt(state, chat, add_generation_prompt=False)
    assert refused.value.param == "messages.1.tool_call_id"


def test_errors_use_the_openai_shape(http: httpx.Client, client: openai.OpenAI) -> None:
    error = assert_openai_error(http.post("/v1/completions", json={"model": "no-such", "prompt": "x"}), 404)
    assert error["code"] == "model_not_found" and "no-such" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    error = assert_openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0}), 400)
    assert error["param"] == "n"
    assert assert_openai_error(http.post("/v1/completions", json={"prompt": "x"}), 400)["param"] == "model"
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


def token_texts(http: httpx.Client, token_ids: list[int]) -> list[str]:
    return [http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in token_ids]


def made_of(text: str, pieces: list[str]) -> bool:
    """Whether ``text`` is a concatenation of ``pieces`` (each any number of times)."""
    while text:
        piece = next((p for p in pieces if p and text.startswith(p)), None)
        if piece is None:
            return False
        text = text[len(piece) :]
    return True


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
    "response_format": ({"type": "json_object"}, "refused"),
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
