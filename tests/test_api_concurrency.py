"""32 concurrent streaming clients on mixed requests (completions and chat, several prompts,
lengths and stop strings; base model and adapters when the engine has them) produce exactly
what the same requests produce one at a time (greedy)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from loraserve.api import ServerSettings, ServerThread, create_app

from loraserve.config import EngineConfig
from loraserve.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

MODEL = "smol"
NUM_CLIENTS = 32
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "My favourite book is",
    "1, 2, 3, 4,",
    "The quick brown fox",
)
SUPPORTS_ADAPTERS = hasattr(LLMEngine, "register_adapter")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    tmp = tmp_path_factory.mktemp("api_concurrency")
    options: dict[str, Any] = {"num_pages": 192, "max_num_seqs": NUM_CLIENTS, "max_num_batched_tokens": 512}
    if "registry" in {field.name for field in dataclasses.fields(EngineConfig)}:
        options["registry"] = f"dir:{tmp / 'registry'}"
    engine = LLMEngine(EngineConfig(**options))
    with ServerThread(create_app(engine, ServerSettings(model_id=MODEL))) as running:
        models = [MODEL]
        if SUPPORTS_ADAPTERS:
            models += upload_adapters(running.url, engine, tmp)
        yield running.url, models


def upload_adapters(url: str, engine: LLMEngine, tmp: Path) -> list[str]:
    from adapter_factory import make_peft_adapter_for_config

    specs = {"ad-r8": (8, ["q_proj", "v_proj"]), "ad-r16": (16, ["q_proj", "k_proj", "o_proj", "down_proj"])}
    for seed, (name, (rank, targets)) in enumerate(specs.items()):
        path = make_peft_adapter_for_config(engine.hf_config, tmp / name, rank=rank, target_modules=targets, seed=seed)
        files = [("files", (f.name, f.read_bytes())) for f in sorted(path.iterdir()) if f.is_file()]
        response = httpx.post(url + "/v1/adapters", data={"name": name}, files=files, timeout=60)
        assert response.status_code == 201, response.text
    return list(specs)


def mixed_requests(models: list[str]) -> list[dict[str, Any]]:
    requests = []
    for i in range(NUM_CLIENTS):
        request: dict[str, Any] = {"model": models[i % len(models)], "max_tokens": 3 + i % 6, "temperature": 0}
        if i % 3 == 0:
            request["messages"] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        else:
            request["prompt"] = PROMPTS[i % len(PROMPTS)]
        if i % 5 == 0:
            request["stop"] = [" the"]
        requests.append(request)
    return requests


async def run_streaming(client: openai.AsyncOpenAI, request: dict[str, Any]) -> tuple[str, str | None]:
    text, finish = "", None
    if "messages" in request:
        async for chunk in await client.chat.completions.create(stream=True, **request):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
    else:
        async for chunk in await client.completions.create(stream=True, **request):
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
    return text, finish


async def run_all_at_once(url: str, requests: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        return list(await asyncio.gather(*(run_streaming(client, request) for request in requests)))
    finally:
        await client.close()


def run_one_at_a_time(url: str, requests: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    results: list[tuple[str, str | None]] = []
    for request in requests:
        if "messages" in request:
            chat = client.chat.completions.create(**request).choices[0]
            results.append((chat.message.content or "", chat.finish_reason))
        else:
            completion = client.completions.create(**request).choices[0]
            results.append((completion.text, completion.finish_reason))
    return results


def test_concurrent_streams_match_sequential(server: tuple[str, list[str]]) -> None:
    url, models = server
    requests = mixed_requests(models)
    concurrent = asyncio.run(run_all_at_once(url, requests))
    sequential = run_one_at_a_time(url, requests)
    for request, got, expected in zip(requests, concurrent, sequential, strict=True):
        assert got == expected, request
    assert all(finish in ("stop", "length") for _, finish in concurrent)
    metrics = httpx.get(url + "/metrics").text
    assert 'loraserve_pool_pages{kind="kv"} 0.0' in metrics


@pytest.mark.skipif(not SUPPORTS_ADAPTERS, reason="waits on the engine's adapter support")
def test_adapters_change_the_output(server: tuple[str, list[str]]) -> None:
    url, models = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    first = {
        model: client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=1, temperature=0, logprobs=1)
        .choices[0]
        .logprobs.token_logprobs[0]  # type: ignore[union-attr,index]
        for model in models
    }
    assert len({round(value, 5) for value in first.values()}) == len(models), first
