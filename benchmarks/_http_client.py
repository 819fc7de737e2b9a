"""The HTTP client of ``benchmarks.serving``: one completion request, and a phase of them, either
closed-loop (at most ``concurrency`` in flight) or on an arrival clock (``benchmarks/_arrivals.py``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm.auto import tqdm

from benchmarks._arrivals import Stream, Timing, latency_summary, percentile


@dataclass
class Result:
    """One request: completion tokens from the final usage chunk; ``ttft_s`` and ``latency_s`` from the
    send; ``first_at``/``last_at``: ``perf_counter()`` of the first and the last chunk with a choice."""

    tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    error: str | None = None
    usage_missing: bool = False
    first_at: float | None = None
    last_at: float | None = None


@dataclass
class Phase:
    name: str
    requests: int
    ok: int
    failed: int
    short: int
    usage_missing: int
    tokens: int
    wall_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    latency_p50_s: float | None
    first_error: str | None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p99_s: float | None = None
    slo_attainment: float | None = None  # share of all requests with a TTFT under --slo-ttft
    ttfts_s: list[float | None] = field(default_factory=list)  # per request (None: failed or not streamed)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


async def complete(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, stream: bool) -> Result:
    """One completion. Streamed: the first chunk with a choice marks the first token. Not streamed
    (one JSON response; no time to first token): the client does almost no work per token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    if not stream:
        return await complete_whole(client, body)
    body["stream_options"] = {"include_usage": True}
    result, chunks, start = Result(), 0, time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    return result
                if chunk.get("choices"):
                    chunks += 1
                    result.last_at = time.perf_counter()
                    result.first_at = result.first_at or result.last_at
                    result.ttft_s = result.ttft_s or result.last_at - start
                if chunk.get("usage"):
                    result.tokens = int(chunk["usage"]["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency_s = time.perf_counter() - start
    if not result.tokens:  # the server sent no usage: count streamed chunks instead
        result.tokens, result.usage_missing = chunks, True
    return result


async def complete_whole(client: httpx.AsyncClient, body: dict[str, Any]) -> Result:
    result, start = Result(), time.perf_counter()
    try:
        response = await client.post("/v1/completions", json=body)
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {response.text[:300]!r}"
            return result
        result.tokens = int(response.json()["usage"]["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError, TypeError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency_s = time.perf_counter() - start
    return result


def summarize(name: str, results: list[Result], expected: Sequence[int], wall: float, sent_at: Sequence[float],
              slo_ttft: float) -> Phase:  # fmt: skip
    """A phase's numbers; TTFT and TPOT p50/p99 and SLO attainment count from ``sent_at[i]`` (the
    arrival time on the arrival clock, the send time in a closed loop)."""
    done = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    timings = [Timing(at, r.first_at, r.last_at, r.tokens) if r.error is None else Timing(at)
               for r, at in zip(results, sent_at, strict=True)]  # fmt: skip
    latency = latency_summary(timings, slo_ttft) if any(r.first_at for r in done) else {}
    return Phase(
        name, len(results), len(done), len(results) - len(done),
        sum(r.tokens < n for r, n in zip(results, expected, strict=True) if r.error is None),
        sum(r.usage_missing for r in done), sum(r.tokens for r in done), wall, percentile(ttfts, 50),
        percentile(ttfts, 90), percentile([r.latency_s for r in done], 50),
        next((r.error for r in results if r.error), None), **{k: v for k, v in latency.items() if k != "ttft_p50_s"},
        ttfts_s=[r.ttft_s if r.error is None else None for r in results],
    )  # fmt: skip


async def run_phase(client: httpx.AsyncClient, name: str, models: list[str], prompts: list[list[int]],
                    max_tokens: int, concurrency: int, stream: bool, slo_ttft: float) -> Phase:  # fmt: skip
    """Every request, ``models[i]`` for request ``i``, at most ``concurrency`` in flight (closed loop)."""
    gate = asyncio.Semaphore(concurrency)
    progress = tqdm(total=len(models), desc=f"{name} (c={concurrency})", unit="req")
    sent_at = [0.0] * len(models)

    async def one(i: int) -> Result:
        async with gate:
            sent_at[i] = time.perf_counter()
            result = await complete(client, models[i], prompts[i], max_tokens, stream)
        progress.update(1)
        return result

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(len(models))))
    wall = time.perf_counter() - start
    progress.close()
    return summarize(name, results, [max_tokens] * len(models), wall, sent_at, slo_ttft)


async def run_arrival_phase(client: httpx.AsyncClient, name: str, models: list[str], work: Stream, stream: bool,
                            slo_ttft: float) -> Phase:  # fmt: skip
    """Request ``i`` sent at its arrival time (open loop: nothing waits for earlier answers); TTFT is
    counted from the arrival time, so a client that sends late cannot hide it."""
    progress = tqdm(total=len(models), desc=f"{name} (arrivals)", unit="req")
    start = time.perf_counter()
    arrive_at = [start + t for t in work.arrivals]

    async def one(i: int) -> Result:
        await asyncio.sleep(max(0.0, arrive_at[i] - time.perf_counter()))
        result = await complete(client, models[i], work.prompts[i], work.output_lens[i], stream)
        if result.first_at is not None:
            result.ttft_s = result.first_at - arrive_at[i]
        progress.update(1)
        return result

    results = await asyncio.gather(*(one(i) for i in range(len(models))))
    wall = time.perf_counter() - start
    progress.close()
    return summarize(name, results, work.output_lens, wall, arrive_at, slo_ttft)
