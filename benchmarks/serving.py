"""HTTP serving benchmark (issues 6 and 19): a workload over an OpenAI-compatible API.

Sends the workload of ``benchmarks.cpu_perf`` (token-id prompts, greedy, ``ignore_eos``, a fixed
number of new tokens) to ``POST /v1/completions`` of any server, streaming, with at most
``--concurrency`` requests in flight; adapters are addressed by the ``model`` field, so the same
client measures loraserve and vLLM alike. Phases: ``base`` (every request on the base model)
and ``lora`` (requests round robin over the adapter ids). See ``benchmarks/CPU_PERF.md``.

With ``--rate`` the requests come instead on S-LoRA's arrival clock (``benchmarks/_arrivals.py``,
as ``benchmarks.many_adapters``): Poisson at ``--rate`` per second (gamma with ``--cv``; ``inf``:
all at once), output lengths uniform in [``--min-output``, ``--max-tokens``], request i of the
``lora`` phase on adapter id ``int(u_i * N)`` with ``u_i ~ power(--alpha)``; each request is sent
at its arrival time whatever is in flight, and TTFT counts from the arrival time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from benchmarks._arrivals import Stream, add_arrival_args, check_arrival_args, make_stream
from benchmarks._http_client import Phase, complete, run_arrival_phase, run_phase
from benchmarks._quick import given_options
from benchmarks._workload import Workload, adapter_name, add_workload_args, ensure_adapters, parse_workload_args


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


async def bench(
    args: argparse.Namespace, url: str, work: Workload, arrivals: Stream | None
) -> tuple[list[str], list[Phase]]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connections = args.concurrency if arrivals is None else max(args.concurrency, len(arrivals))  # open loop: all
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=args.timeout) as client:
        ids = args.model_ids or await discover(client, args.adapters)
        base, adapter_ids = ids[0], ids[1:]
        plans = {"base": [base] * len(work.prompts)}
        if adapter_ids and arrivals is None:
            plans["lora"] = [adapter_ids[a % len(adapter_ids)] for a in work.adapter_of]
        elif adapter_ids and arrivals is not None:  # S-LoRA's draw: int(u * N) over the adapter ids
            plans["lora"] = [adapter_ids[a] for a in arrivals.adapters(len(adapter_ids))]
        stream = not args.no_stream
        warm = await asyncio.gather(*(complete(client, m, work.prompts[0][:8], 2, stream) for m in ids))  # warm-up
        if errors := [f"{m}: {r.error}" for m, r in zip(ids, warm, strict=True) if r.error]:
            raise SystemExit("warm-up failed: " + "; ".join(errors))
        phases = []
        for name in args.phases:
            if arrivals is None:
                phase = run_phase(client, name, plans[name], work.prompts, work.max_tokens, args.concurrency, stream,
                                  args.slo_ttft)  # fmt: skip
            else:
                phase = run_arrival_phase(client, name, plans[name], arrivals, stream, args.slo_ttft)
            phases.append(await phase)
    return ids, phases


def describe_arrivals(args: argparse.Namespace, arrivals: Stream) -> str:
    process = "Poisson" if args.cv == 1 else f"gamma cv={args.cv}"
    rate = "all at t=0" if math.isinf(args.rate) else f"{args.rate}/s, {process}"
    return (
        f"{len(arrivals)} requests (seed {args.seed}) arriving {rate}, prompts {args.min_prompt}-{args.max_prompt} "
        f"tokens, outputs {args.min_output}-{args.max_tokens} tokens (uniform, inclusive), greedy, EOS ignored; "
        f"lora phase: adapter id int(u*N), u ~ power({args.alpha}); open loop"
    )


def report(info: dict[str, Any], args: argparse.Namespace, url: str, ids: list[str], work: Workload,
           phases: list[Phase], arrivals: Stream | None = None) -> str:  # fmt: skip
    """Markdown: client machine, server, workload, one row per phase."""
    fmt = lambda v, scale=1.0, spec=".2f": "-" if v is None else format(v * scale, spec)  # noqa: E731
    workload = (f"{work.describe(args)}; concurrency {args.concurrency}" if arrivals is None
                else describe_arrivals(args, arrivals))  # fmt: skip
    lines = [
        f"Client machine: {info['cpu']} ({info['isa']}: {info['cpu_flags']}), {info['usable_cores']} usable of "
        f"{info['logical_cores']} cores; load average {info['load_avg_at_start']} at start, "
        f"{info['load_avg_at_end']} at end",
        f"Server kernels (its /health): {_server_kernels(info.get('server_health'))}",
        f"Server: {url} ({'loraserve in this process, ' + args.dtype if args.start_loraserve else 'external'}); "
        f"base model {ids[0]!r}, adapters {ids[1:]}",
        f"Workload: {workload}, {'plain JSON responses (not streamed)' if args.no_stream else 'streamed (SSE)'}",
        "",
        "| phase | requests | ok | failed | short | gen. tokens | wall s | tok/s | req/s | TTFT p50 s | TTFT p90 s "
        f"| TTFT p99 s | TPOT p50 ms | TPOT p99 ms | TTFT < {args.slo_ttft:g} s | latency p50 s |",
        "|---|" + "---:|" * 15,
    ]
    for p in phases:
        lines.append(
            f"| {p.name} | {p.requests} | {p.ok} | {p.failed} | {p.short} | {p.tokens} | {p.wall_s:.1f} "
            f"| {p.tok_s:.1f} | {p.ok / p.wall_s:.3f} | {fmt(p.ttft_p50_s)} | {fmt(p.ttft_p90_s)} "
            f"| {fmt(p.ttft_p99_s)} | {fmt(p.tpot_p50_s, 1e3, '.0f')} | {fmt(p.tpot_p99_s, 1e3, '.0f')} "
            f"| {fmt(p.slo_attainment, 1, '.0%')} | {fmt(p.latency_p50_s)} |"
        )
    by_name = {p.name: p for p in phases}
    if "base" in by_name and "lora" in by_name:
        lines += ["", f"lora / base tokens/s: {by_name['lora'].tok_s / by_name['base'].tok_s:.2f}x"]
    lines += [f"First error ({p.name}): {p.first_error}" for p in phases if p.first_error]
    lines += [f"{p.name}: {p.usage_missing} responses had no usage; streamed chunks counted" for p in phases
              if p.usage_missing]  # fmt: skip
    return "\n".join(lines)


def _server_kernels(health: dict[str, Any] | None) -> str:
    """A loraserve server's kernel backend, GEMM choice per layer shape and LoRA way per segment length;
    other servers say none."""
    if not health or "kernels" not in health:
        return "not reported (not a loraserve server)"
    gemm = health.get("cpu_gemm")
    if not gemm:
        return str(health["kernels"])
    shapes = "; ".join(f"{shape} {'/'.join(by_rows.values())}" for shape, by_rows in gemm["layers"].items())
    widest: dict[str, str] = max(gemm["layers"].values(), key=len)  # the row buckets of any shape
    rows = "/".join(widest)
    lora = health.get("cpu_lora") or {}
    by_length = ", ".join(f"{tokens} {way}" for tokens, way in lora.get("segment_tokens", {}).items())
    block = f", expand rank block {lora['expand_rank_block']}" if "expand_rank_block" in lora else ""
    block += f" ({lora['expand']})" if "expand" in lora else ""
    lora_part = f"; LoRA per segment length ({lora['source']}): {by_length}{block}" if by_length else ""
    return f"{health['kernels']}; GEMM kernel per row bucket ({rows} rows, {gemm['source']}): {shapes}{lora_part}"


def _flags(dests: list[str]) -> str:
    return ", ".join("--" + dest.replace("_", "-") for dest in dests)


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
    group = parser.add_argument_group("arrivals (S-LoRA's workload; benchmarks/_arrivals.py)")
    add_arrival_args(group, rate=None)
    group.add_argument(
        "--min-output",
        type=int,
        default=None,
        help="with --rate: outputs uniform in [this, --max-tokens] (default: all --max-tokens)",
    )
    add("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parse_workload_args(parser, argv)
    check_arrival_args(parser, args)
    given = given_options(parser, argv)
    if args.rate is None and (ignored := sorted(given & {"cv", "alpha", "min_output"})):
        parser.error(f"{_flags(ignored)} shape the arrival process: give --rate (inf: all at once) too")
    if args.rate is not None and "concurrency" in given:
        parser.error("--concurrency bounds the closed loop without --rate; with --rate, arrivals are open loop")
    if not args.start_loraserve and (ignored := sorted(given & {"max_num_seqs", "dtype", "threads"})):
        parser.error(f"{_flags(ignored)} configure the server --start-loraserve starts; set them on your own server")
    args.min_output = args.max_tokens if args.min_output is None else args.min_output
    if not 1 <= args.min_output <= args.max_tokens:
        parser.error("need 1 <= --min-output <= --max-tokens")
    if set(args.phases) - {"base", "lora"} or args.concurrency < 1:
        parser.error("--phases takes base and/or lora; --concurrency must be positive")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    from benchmarks.throughput import machine_info
    from loraserve.models.loader import default_model_dir, load_hf_config

    hf_config = load_hf_config(default_model_dir())
    if args.print_lora_modules:  # writes the adapters first if needed
        print(" ".join(f"{name}={path}" for name, path in ensure_adapters(args, hf_config)))
        return None
    work = Workload.make(args, int(hf_config.vocab_size))
    arrivals = None
    if args.rate is not None:
        arrivals = make_stream(args.requests, (args.min_prompt, args.max_prompt + 1),
                               (args.min_output, args.max_tokens + 1), int(hf_config.vocab_size), rate=args.rate,
                               cv=args.cv, alpha=args.alpha, seed=args.seed)  # fmt: skip
    info = machine_info()
    with contextlib.ExitStack() as stack:
        url = args.url
        if args.start_loraserve:
            url = stack.enter_context(local_loraserve(args, ensure_adapters(args, hf_config)))
        with contextlib.suppress(httpx.HTTPError, ValueError):
            info["server_health"] = httpx.get(url.rstrip("/") + "/health", timeout=10).json()
        try:
            ids, phases = asyncio.run(bench(args, url.rstrip("/"), work, arrivals))
        except httpx.HTTPError as error:
            raise SystemExit(f"{url}: {type(error).__name__}: {error}") from None
    info["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(report(info, args, url, ids, work, phases, arrivals), flush=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "api_key"}
    payload = {"machine": info, "args": settings, "model_ids": ids,
               "phases": [{**asdict(p), "tok_s": p.tok_s} for p in phases]}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return payload


if __name__ == "__main__":
    main()
