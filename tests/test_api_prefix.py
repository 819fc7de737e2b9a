"""Prefix caching through the HTTP API (tiny model, real uvicorn server): ``cached_tokens`` in
``usage``, the vLLM ``cache_salt`` extension, and the prefix-cache metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from adapter_factory import make_peft_adapter_for_config
from loraserve.api import ServerSettings, ServerThread, create_app
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoConfig

from loraserve.config import EngineConfig
from loraserve.llm_engine import LLMEngine

MODEL = "tiny"
BLOCK = 16
PROMPT_LEN = 75  # 4 full blocks reusable: (75 - 1) // 16 * 16 = 64
NUM_PAGES = 40

Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, LLMEngine]]:
    config = EngineConfig(model=str(tiny_model_dir), block_size=BLOCK, num_pages=NUM_PAGES, max_num_seqs=4)
    engine = LLMEngine(config)
    adapter_dir = tmp_path_factory.mktemp("prefix-api-adapter") / "a"
    hf_config = AutoConfig.from_pretrained(tiny_model_dir)
    engine.add_adapter("a", make_peft_adapter_for_config(hf_config, adapter_dir, rank=8, target_modules=["q_proj"]))
    with ServerThread(create_app(engine, ServerSettings(model_id=MODEL))) as running:
        yield running, engine


@pytest.fixture(scope="module")
def http(server: tuple[ServerThread, LLMEngine]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0].url, timeout=60) as client:
        yield client


def prompt_ids(seed: int, length: int = PROMPT_LEN) -> list[int]:
    """A token-id prompt unique to ``seed`` (so tests never hit each other's blocks)."""
    return [100 + (seed * 7919 + i * 31) % 20000 for i in range(length)]


def complete(http: httpx.Client, prompt: list[int], **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def cached(response: dict[str, Any]) -> int:
    return int(response["usage"]["prompt_tokens_details"]["cached_tokens"])


def metric_values(http: httpx.Client) -> Metrics:
    response = http.get("/metrics")
    assert response.status_code == 200
    values: Metrics = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def test_same_prompt_twice_reuses_full_blocks(http: httpx.Client) -> None:
    prompt = prompt_ids(1)
    first = complete(http, prompt)
    second = complete(http, prompt)
    assert first["usage"]["prompt_tokens"] == PROMPT_LEN
    assert cached(first) == 0
    assert cached(second) == (PROMPT_LEN - 1) // BLOCK * BLOCK == 64
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_cache_salt_isolates(http: httpx.Client) -> None:
    prompt = prompt_ids(2)
    assert cached(complete(http, prompt, cache_salt="tenant-1")) == 0
    assert cached(complete(http, prompt, cache_salt="tenant-2")) == 0
    assert cached(complete(http, prompt)) == 0  # unsalted requests never see salted blocks
    assert cached(complete(http, prompt, cache_salt="tenant-1")) == 64
    assert cached(complete(http, prompt)) == 64
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "cache_salt": ""})
    assert response.status_code in (400, 422), response.text


def test_adapter_does_not_share_base_blocks(http: httpx.Client) -> None:
    prompt = prompt_ids(3)
    assert cached(complete(http, prompt)) == 0
    assert cached(complete(http, prompt, model="a")) == 0
    assert cached(complete(http, prompt, model="a")) == 64


def test_chat_and_streaming_report_cached_tokens(server: tuple[ServerThread, LLMEngine]) -> None:
    client = openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages: Any = [
        {"role": "system", "content": "You answer in one word. " * 12},
        {"role": "user", "content": "Sky colour?"},
    ]
    extra = {"cache_salt": "chat", "ignore_eos": True}
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, extra_body=extra
    )
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    expected = (first.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert expected > 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    usages = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usages) == 1 and usages[0].prompt_tokens_details is not None
    assert usages[0].prompt_tokens_details.cached_tokens == expected


def test_metrics_show_hits_and_evictions(http: httpx.Client) -> None:
    before = metric_values(http)
    prompt = prompt_ids(4)
    complete(http, prompt)
    complete(http, prompt)
    after = metric_values(http)

    def delta(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert after[("loraserve_prefix_cache_enabled", ())] == 1
    assert delta("loraserve_prefix_cache_queried_tokens_total") == 2 * PROMPT_LEN
    assert delta("loraserve_prefix_cache_matched_tokens_total") == 64
    assert delta("loraserve_prefix_cache_hit_tokens_total", (("model", MODEL),)) == 64
    assert delta("loraserve_prefix_cache_hits_total", (("model", MODEL),)) == 1
    queried = after[("loraserve_prefix_cache_queried_tokens_total", ())]
    matched = after[("loraserve_prefix_cache_matched_tokens_total", ())]
    assert after[("loraserve_prefix_cache_hit_rate", ())] == pytest.approx(matched / queried)
    assert after[("loraserve_pool_pages", (("kind", "prefix_cache"),))] > 0
    assert after[("loraserve_prefix_cache_blocks", ())] > 0
    # Distinct prompts overflow the small pool: idle cached blocks are evicted, and counted.
    for seed in range(10, 10 + NUM_PAGES // 4):
        complete(http, prompt_ids(seed))
    final = metric_values(http)
    assert final[("loraserve_pool_evictions_total", (("kind", "prefix_cache"),))] > 0
