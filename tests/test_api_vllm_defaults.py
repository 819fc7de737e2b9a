"""What vLLM 0.32's OpenAI server does with fields left out, null, empty or client-chosen, done the
same here: the model's generation config as the sampling defaults (``--generation-config``), null
meaning the default, an empty ``model`` the base model, ``seed: -1`` a random seed, the response id
from ``X-Request-Id`` or ``request_id``, ``reasoning_effort`` to the chat template, ``echo`` with
``max_tokens: 0`` the prompt scored; and vLLM's fields that change the output and that loraserve
does not implement refused by name."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from base_model_server import MODEL, PROMPT, USER_HI, assert_openai_error
from loraserve.api import ServerSettings, ServerThread, create_app
from loraserve.api.generation_defaults import load_sampling_defaults
from loraserve.api.openai_protocol import ChatCompletionRequest
from loraserve.api.routes_chat import template_variables

from loraserve.config import EngineConfig
from loraserve.entrypoints.serve import add_serve_parser, build_settings
from loraserve.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

DEFAULTS = {"temperature": 0.0, "max_tokens": 5}  # the server's, as from a generation config


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    engine = LLMEngine(EngineConfig(num_pages=96, max_num_seqs=8, max_num_batched_tokens=512))
    settings = ServerSettings(model_id=MODEL, sampling_defaults=DEFAULTS)
    with ServerThread(create_app(engine, settings)) as running, httpx.Client(base_url=running.url, timeout=120) as c:
        yield c


def _text(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


def test_fields_left_out_take_the_servers_defaults(http: httpx.Client) -> None:
    """temperature 0 from the defaults: greedy, as the same request with temperature 0 sent; a
    chat with no max_tokens stops at the default 5; n > 1 is greedy's 400 as vLLM's; a value
    sent wins over the default."""
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
    greedy = _text(http.post("/v1/completions", json={**base, "temperature": 0}))
    assert _text(http.post("/v1/completions", json=base)) == greedy
    assert _text(http.post("/v1/completions", json={**base, "temperature": None})) == greedy
    assert_openai_error(http.post("/v1/completions", json={**base, "n": 2}), 400)
    sampled = [_text(http.post("/v1/completions", json={**base, "temperature": 1.0, "seed": s})) for s in range(4)]
    assert any(text != greedy for text in sampled)  # the request's temperature, not the default's
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [USER_HI], "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 5
    asked = {"model": MODEL, "messages": [USER_HI], "ignore_eos": True, "max_completion_tokens": 7}
    assert http.post("/v1/chat/completions", json=asked).json()["usage"]["completion_tokens"] == 7
    unsent = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "ignore_eos": True})
    assert unsent.json()["usage"]["completion_tokens"] == 16  # completions: OpenAI's 16, as vLLM


def test_null_and_empty_mean_the_default(http: httpx.Client) -> None:
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
    nulls = {"n": None, "stream": None, "echo": None}
    assert _text(http.post("/v1/completions", json={**base, **nulls})) == _text(http.post("/v1/completions", json=base))
    chat = {"model": MODEL, "messages": [USER_HI], "max_tokens": 3}
    chat_nulls = {"n": None, "stream": None, "logprobs": None, "top_logprobs": 0}
    reply = http.post("/v1/chat/completions", json={**chat, **chat_nulls})
    assert reply.status_code == 200 and reply.json()["choices"][0]["logprobs"] is None
    options = {"stream": True, "stream_options": {"include_usage": None, "continuous_usage_stats": None}}
    with http.stream("POST", "/v1/completions", json={**base, **options}) as streamed:
        chunks = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    assert streamed.status_code == 200 and all(json.loads(c[6:]).get("usage") is None for c in chunks)
    for route, body in (("/v1/completions", base), ("/v1/chat/completions", chat), ("/tokenize", {"prompt": "x"})):
        assert http.post(route, json={**body, "model": ""}).status_code == 200, route  # the base model
    assert_openai_error(http.post("/v1/chat/completions", json={**chat, "top_logprobs": 2}), 400)


def test_seed_minus_one_is_random(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    fixed = {_text(http.post("/v1/completions", json={**body, "seed": 3})) for _ in range(2)}
    assert len(fixed) == 1
    drawn = {_text(http.post("/v1/completions", json={**body, "seed": -1})) for _ in range(3)}
    assert len(drawn) > 1


def test_response_ids_from_the_header_or_the_body(http: httpx.Client) -> None:
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    assert http.post("/v1/completions", json=base, headers={"X-Request-Id": "abc"}).json()["id"] == "cmpl-abc"
    header_first = http.post("/v1/completions", json={**base, "request_id": "body"}, headers={"X-Request-Id": "h"})
    assert header_first.json()["id"] == "cmpl-h"
    chat = {"model": MODEL, "messages": [USER_HI], "max_tokens": 2, "request_id": "mine"}
    assert http.post("/v1/chat/completions", json=chat).json()["id"] == "chatcmpl-mine"
    streamed = {**base, "stream": True, "max_tokens": 40, "ignore_eos": True}
    with (  # two requests in flight with one client-chosen id: both run (the engine's ids are unique)
        http.stream("POST", "/v1/completions", json=streamed, headers={"X-Request-Id": "same"}) as first,
        http.stream("POST", "/v1/completions", json=streamed, headers={"X-Request-Id": "same"}) as second,
    ):
        for reply in (first, second):
            chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
            assert reply.status_code == 200 and {c["id"] for c in chunks} == {"cmpl-same"}
            assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks if c["choices"]) > 0


def test_vllm_fields_loraserve_does_not_implement_are_refused_by_name(http: httpx.Client) -> None:
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    refused = {"logprob_token_ids": [5], "thinking_token_budget": 0, "vllm_xargs": {"a": 1},
               "repetition_detection": {"max_pattern_size": 4}, "kv_transfer_params": {"x": 1}}  # fmt: skip
    for name, value in refused.items():
        assert assert_openai_error(http.post("/v1/completions", json={**base, name: value}), 400)["param"] == name
    assert http.post("/v1/completions", json={**base, "logprob_token_ids": []}).status_code == 200  # vLLM: unset
    assert assert_openai_error(http.post("/v1/completions", json={**base, "temperature": 2.5}), 400)
    chat = {"model": MODEL, "messages": [USER_HI], "max_tokens": 2}
    error = assert_openai_error(http.post("/v1/chat/completions", json={**chat, "tool_choice": "auto"}), 400)
    assert error["param"] == "tool_choice" and "`tools` must be set" in error["message"]
    assert http.post("/v1/chat/completions", json={**chat, "tool_choice": "none"}).status_code == 200
    assert http.post("/v1/chat/completions", json={**chat, "reasoning_effort": "none"}).status_code == 200
    assert_openai_error(http.post("/v1/chat/completions", json={**chat, "reasoning_effort": "huge"}), 400)


def test_reasoning_effort_reaches_the_template_as_vllm_hands_it_over() -> None:
    def variables(**fields: object) -> dict[str, object] | None:
        return template_variables(ChatCompletionRequest.model_validate({"messages": [USER_HI], **fields}))

    assert variables() is None
    assert variables(reasoning_effort="none") == {"reasoning_effort": "none", "enable_thinking": False}
    assert variables(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False, "x": 1}) == {
        "reasoning_effort": "high", "enable_thinking": False, "x": 1}  # fmt: skip


def test_generation_config_sources(tmp_path: Path) -> None:
    """``auto``: the model directory's generation_config.json, fields that differ from Hugging
    Face's defaults (vLLM's reading), max_new_tokens as max_tokens; ``vllm``: none; a directory:
    its file; overrides over either; bad values refused by name, before any model loads."""
    model = tmp_path / "model"
    model.mkdir()
    config = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64, "do_sample": True, "eos_token_id": 2}
    (model / "generation_config.json").write_text(json.dumps(config))
    assert load_sampling_defaults(model, "auto", None) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                          "max_tokens": 64}  # fmt: skip
    assert load_sampling_defaults(model, "vllm", None) == {}
    assert load_sampling_defaults(model, "vllm", '{"repetition_penalty": 1.1}') == {"repetition_penalty": 1.1}
    assert load_sampling_defaults(tmp_path, str(model), '{"temperature": 0}')["temperature"] == 0.0
    assert load_sampling_defaults(tmp_path, "auto", None) == {}  # no file: OpenAI's defaults
    bad = {
        "no generation_config.json": (str(tmp_path), None),
        "not JSON": ("vllm", "{x"),
        "must be a JSON object": ("vllm", "[1]"),
        "'top_k' must be an integer": ("vllm", '{"top_k": 1.5}'),
        "temperature": ("vllm", '{"temperature": -1}'),
        "'top_p' must be a number": ("vllm", '{"top_p": "high"}'),
    }
    for message, (source, overrides) in bad.items():
        with pytest.raises(ValueError, match=message):
            load_sampling_defaults(model, source, overrides)
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--override-generation-config", '{"min_p": 0.05}'])
    assert build_settings(args, model).sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                            "max_tokens": 64, "min_p": 0.05}  # fmt: skip


def test_too_many_choices_name_the_field_at_fault(http: httpx.Client) -> None:
    many = {"model": MODEL, "prompt": ["x"] * 300, "max_tokens": 1}
    assert assert_openai_error(http.post("/v1/completions", json=many), 400)["param"] == "prompt"
    samples = {"model": MODEL, "prompt": ["x", "y"], "max_tokens": 1, "n": 200, "temperature": 1}
    assert assert_openai_error(http.post("/v1/completions", json=samples), 400)["param"] == "n"


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(http: httpx.Client) -> None:
    """vLLM's prompt scoring (lm-eval-harness's loglikelihood requests): the prompt's text and
    tokens with their logprobs (the first without one), nothing generated after them, whole or
    streamed; max_tokens 0 without echo is vLLM's 400."""
    prompts = [PROMPT, "Paris is a city"]
    body = {"model": MODEL, "prompt": prompts, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    for prompt, choice in zip(prompts, choices, strict=True):
        ids = http.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
        scored = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                    "prompt_logprobs": 1}).json()["choices"][0]  # fmt: skip
        entries = scored["prompt_logprobs"][1:]
        expected = [entry[str(token)]["logprob"] for token, entry in zip(ids[1:], entries, strict=True)]
        logprobs = choice["logprobs"]
        assert (
            choice["text"] == prompt and "".join(logprobs["tokens"]) == prompt and len(logprobs["tokens"]) == len(ids)
        )
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
        assert choice["finish_reason"] == "length"
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    for index, choice in enumerate(choices):
        mine = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == index]
        assert "".join(part["text"] for part in mine) == choice["text"]
        tokens = [token for part in mine for token in (part["logprobs"] or {}).get("tokens", [])]
        assert tokens == choice["logprobs"]["tokens"] and mine[-1]["finish_reason"] == "length"
    plain = http.post("/v1/completions", json={**body, "prompt": PROMPT, "logprobs": None}).json()["choices"][0]
    assert plain["text"] == PROMPT and plain["logprobs"] is None
    alone = {"model": MODEL, "prompt": PROMPT, "max_tokens": 0}
    assert assert_openai_error(http.post("/v1/completions", json=alone), 400)["param"] == "max_tokens"
