"""The limits an operator sets (``ServerSettings``, ``EngineConfig.max_lora_rank``/``max_adapters``):
request body size (413, announced or chunked), ``n``, prompt length and ``max_tokens`` (400 naming
the field), requests in flight per API key (429, released when a request ends), adapter rank and
count (400 naming the limit; nothing stored, an existing adapter may still be replaced)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from adapter_factory import make_peft_adapter_for_config
from loraserve.api import ServerSettings, ServerThread, create_app
from loraserve.api.errors import APIError
from loraserve.api.limits import InFlightLimiter

from loraserve.config import EngineConfig
from loraserve.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

MODEL = "smol"
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, LLMEngine]]:
    tmp = tmp_path_factory.mktemp("api_limits")
    config = EngineConfig(num_pages=128, max_num_seqs=8, registry=f"dir:{tmp / 'registry'}", max_lora_rank=16,
                          max_adapters=2)  # fmt: skip
    engine = LLMEngine(config)
    settings = ServerSettings(model_id=MODEL, max_request_body_bytes=4096, max_n=2, max_prompt_tokens=60,
                              max_output_tokens=8, max_requests_per_key=1)  # fmt: skip
    with ServerThread(create_app(engine, settings)) as running, httpx.Client(base_url=running.url, timeout=120) as http:
        yield http, engine


def error_of(reply: httpx.Response, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    error: dict[str, Any] = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status  # vLLM's: the HTTP status
    return error


def test_request_body_size(server: tuple[httpx.Client, LLMEngine]) -> None:
    http, _ = server
    big = {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 2}
    assert error_of(http.post("/v1/completions", json=big), 413)["code"] == 413

    def chunks() -> Iterator[bytes]:  # no content-length: sent chunked
        data = json.dumps(big).encode()
        for start in range(0, len(data), 1000):
            yield data[start : start + 1000]

    chunked = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "max-request-body-mb" in error_of(chunked, 413)["message"]
    small = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
    assert http.post("/v1/completions", content=small, headers={"content-type": "application/json"}).status_code == 200


def test_n_prompt_and_output_limits(server: tuple[httpx.Client, LLMEngine]) -> None:
    http, _ = server
    base = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4}
    assert error_of(http.post("/v1/completions", json={**base, "n": 3}), 400)["param"] == "n"
    for prompt in ("word " * 80, list(range(100, 170))):
        assert error_of(http.post("/v1/completions", json={**base, "prompt": prompt}), 400)["param"] == "prompt"
    assert error_of(http.post("/v1/completions", json={**base, "max_tokens": 9}), 400)["param"] == "max_tokens"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    reply = http.post("/v1/chat/completions", json=chat)  # no max_tokens: capped at the limit
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
    too_many = http.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 9})
    assert error_of(too_many, 400)["param"] == "max_tokens"
    long_chat = {**chat, "messages": [{"role": "user", "content": "word " * 80}]}
    assert error_of(http.post("/v1/chat/completions", json=long_chat), 400)["param"] == "prompt"
    assert http.post("/v1/completions", json={**base, "n": 2}).status_code == 200
    unasked = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "ignore_eos": True})
    assert unasked.json()["usage"]["completion_tokens"] == 8  # the default 16, capped at the limit


def test_requests_in_flight_per_key(server: tuple[httpx.Client, LLMEngine]) -> None:
    http, _ = server
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 8, "ignore_eos": True}
    key_a, key_b = {"Authorization": "Bearer a"}, {"Authorization": "Bearer b"}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=key_a) as held:
        lines = held.iter_lines()
        next(lines)  # key a has one request in flight
        assert http.get("/load").json() == {"server_load": 1}  # vLLM's route: requests in flight
        busy = http.post("/v1/completions", json=body, headers=key_a)
        assert error_of(busy, 429)["code"] == 429
        # No key is checked here: another made-up token, or the scheme in other case, is the same bucket.
        assert error_of(http.post("/v1/completions", json=body, headers=key_b), 429)["code"] == 429
        assert http.post("/v1/completions", json=body, headers={"Authorization": "bearer a"}).status_code == 429
        for _ in lines:
            pass
    assert http.post("/v1/completions", json=body, headers=key_a).status_code == 200  # released when it ended
    assert http.get("/load").json() == {"server_load": 0}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=chat, headers=key_a).status_code == 200


def test_in_flight_buckets_are_the_servers_keys() -> None:
    """The server's API key and admin key each count their own requests, the bearer scheme read in
    any case (as the key check reads it); every other request shares one bucket."""
    limiter = InFlightLimiter(1, api_key="k", admin_key="adm")
    headers = ("Bearer k", "bearer k", "BEARER k", "Bearer adm", "Bearer x", "Bearer kk", "Basic k", "", None)
    buckets = {header: limiter.bucket_of(header) for header in headers}
    assert buckets == {"Bearer k": "api", "bearer k": "api", "BEARER k": "api", "Bearer adm": "admin",
                       "Bearer x": "anonymous", "Bearer kk": "anonymous", "Basic k": "anonymous", "": "anonymous",
                       None: "anonymous"}  # fmt: skip
    assert InFlightLimiter(1).bucket_of("Bearer k") == "anonymous"  # no keys: no buckets of made-up tokens
    limiter.acquire("api")
    with pytest.raises(APIError, match="too many requests in flight"):
        limiter.acquire("api")
    limiter.acquire("anonymous")  # the other buckets are free
    limiter.release("api")
    limiter.acquire("api")
    assert limiter.total() == 2


def test_adapter_rank_and_count(server: tuple[httpx.Client, LLMEngine], tmp_path: Path) -> None:
    http, engine = server

    def files(rank: int, seed: int) -> list[tuple[str, tuple[str, bytes, str]]]:
        path = make_peft_adapter_for_config(engine.hf_config, tmp_path / f"r{rank}s{seed}", rank=rank,
                                            target_modules=["q_proj", "v_proj"], seed=seed)  # fmt: skip
        return [("files", (name, (path / name).read_bytes(), "application/octet-stream")) for name in (CONFIG, WEIGHTS)]

    too_big = http.post("/v1/adapters", data={"name": "big"}, files=files(32, 1))
    assert "max_lora_rank" in error_of(too_big, 400)["message"]
    assert http.post("/v1/adapters", data={"name": "one"}, files=files(8, 2)).status_code in (200, 201)
    assert http.post("/v1/adapters", data={"name": "two"}, files=files(16, 3)).status_code in (200, 201)
    third = http.post("/v1/adapters", data={"name": "three"}, files=files(8, 4))
    assert "max_adapters" in error_of(third, 409)["message"]  # the registry is full; the adapter is fine
    assert sorted(card["id"] for card in http.get("/v1/adapters").json()["data"]) == ["one", "two"]  # nothing stored
    assert http.delete("/v1/adapters/one").status_code == 200
    assert http.post("/v1/adapters", data={"name": "three"}, files=files(8, 4)).status_code in (200, 201)
