"""HTTP serving benchmark (issue 6): the CPU-performance workload over an OpenAI-compatible API.

Sends the workload of ``benchmarks.cpu_perf`` (token-id prompts, greedy, ``ignore_eos``, a fixed
number of new tokens) to ``POST /v1/completions`` of any server, streaming, with at most
``--concurrency`` requests in flight; adapters are addressed by the ``model`` field, so the same
client measures loraserve and vLLM alike. Phases: ``base`` (every request on the base model)
and ``lora`` (requests round robin over the adapter ids). See ``benchmarks/CPU_PERF.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm.auto import tqdm

from benchmarks._workload import Workload, adapter_name, add_workload_args, check_workload_args, ensure_adapters


@dataclass
class Result:
    """One request: completion tokens from the final usage chunk, times from the send."""

    tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    error: str | None = None
    usage_missing: bool = False


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

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


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
                    result.ttft_s = result.ttft_s or time.perf_counter() - start
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


async def run_phase(
    client: httpx.AsyncClient, name: str, models: list[str], work: Workload, concurrency: int, stream: bool
) -> Phase:
    """Every request of the workload, ``models[i]`` for request ``i``, at most ``concurrency`` in flight."""
    gate = asyncio.Semaphore(concurrency)
    progress = tqdm(total=len(models), desc=f"{name} (c={concurrency})", unit="req")

    async def one(i: int) -> Result:
        async with gate:
            result = await complete(client, models[i], work.prompts[i], work.max_tokens, stream)
        progress.update(1)
        return result

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(len(models))))
    wall = time.perf_counter() - start
    progress.close()
    done = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    return Phase(
        name, len(results), len(done), len(results) - len(done), sum(r.tokens < work.max_tokens for r in done),
        sum(r.usage_missing for r in done), sum(r.tokens for r in done), wall, percentile(ttfts, 50),
        percentile(ttfts, 90), percentile([r.latency_s for r in done], 50),
        next((r.error for r in results if r.error), None),
    )  # fmt: skip


async def discover(client: httpx.AsyncClient, num_adapters: int) -> list[str]:
    """Base model id then adapter ids from ``GET /v1/models`` (cards with a ``parent`` are adapters).

    Prefers the workload's names ``a0``, ``a1``, ... when the server has all of them.
    """
    response = await client.get("/v1/models")
    response.raise_for_status()
    cards = response.json()["data"]
    bases = [c["id"] for c in cards if not c.get("parent")]
    found = [c["id"] for c in cards if c.get("parent")]
    wanted = [adapter_name(i) for i in range(num_adapters)]
    if set(wanted) <= set(found):
        return [bases[0], *wanted]
    natural = sorted(
        found, key=lambda s: [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", s)]
    )
    return [bases[0], *natural]


@contextlib.contextmanager
def local_loraserve(args: argparse.Namespace, adapters: list[tuple[str, Path]]) -> Iterator[str]:
    """loraserve's app under uvicorn on a thread of this process, the adapters registered; yields its URL."""
    from loraserve.api import ServerSettings, ServerThread, create_app

    from loraserve.config import EngineConfig
    from loraserve.llm_engine import LLMEngine
    from loraserve.models.loader import DEFAULT_MODEL_NAME

    options = {"max_num_seqs": args.max_num_seqs, "dtype": args.dtype, "num_threads": args.threads}
    engine = LLMEngine(EngineConfig.from_options(None, **{k: v for k, v in options.items() if v is not None}))
    for name, path in adapters:
        engine.add_adapter(name, path)
    settings = ServerSettings(model_id=DEFAULT_MODEL_NAME, admin_key=secrets.token_hex(16))  # adapters: no changes
    with ServerThread(create_app(engine, settings)) as server:
        yield server.url


async def bench(args: argparse.Namespace, url: str, work: Workload) -> tuple[list[str], list[Phase]]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=args.timeout) as client:
        ids = args.model_ids or await discover(client, args.adapters)
        base, adapter_ids = ids[0], ids[1:]
        plans = {"base": [base] * len(work.prompts)}
        if adapter_ids:
            plans["lora"] = [adapter_ids[a % len(adapter_ids)] for a in work.adapter_of]
        stream = not args.no_stream
        warm = await asyncio.gather(*(complete(client, m, work.prompts[0][:8], 2, stream) for m in ids))  # warm-up
        if errors := [f"{m}: {r.error}" for m, r in zip(ids, warm, strict=True) if r.error]:
            raise SystemExit("warm-up failed: " + "; ".join(errors))
        phases = [await run_phase(client, name, plans[name], work, args.concurrency, stream) for name in args.phases]
    return ids, phases


def report(info: dict[str, Any], args: argparse.Namespace, url: str, ids: list[str], work: Workload,
           phases: list[Phase]) -> str:  # fmt: skip
    """Markdown: client machine, server, workload, one row per phase."""
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [
        f"Client machine: {info['cpu']} ({info['isa']}: {info['cpu_flags']}), {info['usable_cores']} usable of "
        f"{info['logical_cores']} cores; load average {info['load_avg_at_start']} at start, "
        f"{info['load_avg_at_end']} at end",
        f"Server kernels (its /health): {_server_kernels(info.get('server_health'))}",
        f"Server: {url} ({'loraserve in this process, ' + args.dtype if args.start_loraserve else 'external'}); "
        f"base model {ids[0]!r}, adapters {ids[1:]}",
        f"Workload: {work.describe(args)}; concurrency {args.concurrency}, "
        f"{'plain JSON responses (not streamed)' if args.no_stream else 'streamed (SSE)'}",
        "",
        "| phase | requests | ok | failed | short | gen. tokens | wall s | tok/s | TTFT p50 s | TTFT p90 s "
        "| latency p50 s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        lines.append(
            f"| {p.name} | {p.requests} | {p.ok} | {p.failed} | {p.short} | {p.tokens} | {p.wall_s:.1f} "
            f"| {p.tok_s:.1f} | {fmt(p.ttft_p50_s)} | {fmt(p.ttft_p90_s)} | {fmt(p.latency_p50_s)} |"
        )
    by_name = {p.name: p for p in phases}
    if "base" in by_name and "lora" in by_name:
        lines += ["", f"lora / base tokens/s: {by_name['lora'].tok_s / by_name['base'].tok_s:.2f}x"]
    lines += [f"First error ({p.name}): {p.first_error}" for p in phases if p.first_error]
    lines += [f"{p.name}: {p.usage_missing} responses had no usage; streamed chunks counted" for p in phases
              if p.usage_missing]  # fmt: skip
    return "\n".join(lines)


def _server_kernels(health: dict[str, Any] | None) -> str:
    """A loraserve server's kernel backend and GEMM choice per layer shape; other servers say none."""
    if not health or "kernels" not in health:
        return "not reported (not a loraserve server)"
    gemm = health.get("cpu_gemm")
    if not gemm:
        return str(health["kernels"])
    shapes = "; ".join(f"{shape} {'/'.join(by_rows.values())}" for shape, by_rows in gemm["layers"].items())
    rows = "/".join(max(gemm["layers"].values(), key=len))
    return f"{health['kernels']}; GEMM kernel per row bucket ({rows} rows, {gemm['source']}): {shapes}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    add = parser.add_argument
    add("--url", default="http://127.0.0.1:8000", help="server base URL (default http://127.0.0.1:8000)")
    add("--model-ids", type=lambda t: [x for x in t.split(",") if x], default=None,
        help="base model id, then adapter ids (default: from GET /v1/models)")  # fmt: skip
    add("--phases", type=lambda t: t.split(","), default=["base", "lora"], help="phases to run (default base,lora)")
    add("--concurrency", type=int, default=64, help="requests in flight (default 64)")
    add("--no-stream", action="store_true", help="plain JSON responses instead of SSE (no TTFT; least client CPU)")
    add("--api-key", default=os.environ.get("LORASERVE_API_KEY"), help="bearer token (default $LORASERVE_API_KEY)")
    add("--timeout", type=float, default=1800.0, help="per-request timeout in seconds (default 1800)")
    add("--start-loraserve", action="store_true", help="serve loraserve in this process, adapters registered")
    add("--print-lora-modules", action="store_true", help="print the adapters as vLLM --lora-modules args; exit")
    group = parser.add_argument_group("engine options for --start-loraserve")
    group.add_argument("--max-num-seqs", type=int, default=64, help="max_num_seqs (default 64)")
    group.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="dtype (default float32)")
    group.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    check_workload_args(parser, args)
    if set(args.phases) - {"base", "lora"} or args.concurrency < 1:
        parser.error("--phases takes base and/or lora; --concurrency must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from benchmarks.throughput import machine_info
    from loraserve.models.loader import default_model_dir, load_hf_config

    hf_config = load_hf_config(default_model_dir())
    if args.print_lora_modules:  # writes the adapters first if needed
        print(" ".join(f"{name}={path}" for name, path in ensure_adapters(args, hf_config)))
        return
    work = Workload.make(args, int(hf_config.vocab_size))
    info = machine_info()
    with contextlib.ExitStack() as stack:
        url = args.url
        if args.start_loraserve:
            url = stack.enter_context(local_loraserve(args, ensure_adapters(args, hf_config)))
        with contextlib.suppress(httpx.HTTPError, ValueError):
            info["server_health"] = httpx.get(url.rstrip("/") + "/health", timeout=10).json()
        try:
            ids, phases = asyncio.run(bench(args, url.rstrip("/"), work))
        except httpx.HTTPError as error:
            raise SystemExit(f"{url}: {type(error).__name__}: {error}") from None
    info["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(report(info, args, url, ids, work, phases), flush=True)
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "api_key"}
        payload = {"machine": info, "args": settings, "model_ids": ids,
                   "phases": [{**asdict(p), "tok_s": p.tok_s} for p in phases]}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
