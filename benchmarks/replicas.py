"""One request stream through the Ray Serve ingress: 1 engine replica, 2 routed by adapter, 2 by load.

The stream is S-LoRA's (``benchmarks/_arrivals.py``): prompts and output lengths drawn once, request
``i`` naming adapter ``int(u_i * N)`` with ``u`` from a power law (``--alpha`` < 1: a few popular
adapters), sent in order by ``--concurrency`` clients, each waiting for its answer (not streamed).
Per phase: throughput, latency p50/p99, and from the ingress's merged ``/metrics`` the adapter
loads of each replica (``loraserve_adapter_loads_total{replica}``) and how many replicas served each
adapter (``loraserve_prompt_tokens_total{model,replica}``): with Serve's multiplexed routing an
adapter should load on one replica; routed by load only, on every one. Each phase starts fresh
replicas (their pools empty); the adapters are uploaded once to a shared directory registry. Each
engine gets ``cpus / replicas`` torch threads (the CPUs of this process's affinity mask).

    python -m benchmarks.replicas                      # the default model, 16 adapters, 256 requests
    python -m benchmarks.replicas --quick              # a tiny random model, 24 requests (a smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks._arrivals import make_stream, percentile
from benchmarks._quick import parse_with_quick
from benchmarks._random_models import make_adapters, make_model

QUICK = {"adapters": 6, "requests": 24, "concurrency": 4, "prompt_len": (8, 32), "output_len": (4, 12)}  # --quick

PHASES = (("1 replica", 1, True), ("2 replicas, routed by adapter", 2, True), ("2 replicas, by load only", 2, False))
FILES = ("adapter_config.json", "adapter_model.safetensors")


def per_replica(text: str, name: str) -> dict[tuple[str, str], float]:
    """``{(replica, model label or ""): value}`` of one metric in the merged exposition."""
    return {(s.labels["replica"], s.labels.get("model", "")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}  # fmt: skip


async def run_stream(url: str, stream: Any, names: list[str], concurrency: int) -> dict[str, Any]:
    order = iter(range(len(stream)))
    latencies: list[float] = []
    tokens, errors = 0, []

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        for i in order:
            body = {"model": names[stream.adapter_of(i, len(names))], "prompt": stream.prompts[i], "temperature": 0,
                    "max_tokens": stream.output_lens[i], "ignore_eos": True}  # fmt: skip
            start = time.perf_counter()
            reply = await client.post(url + "/v1/completions", json=body)
            if reply.status_code != 200:
                errors.append(f"{reply.status_code}: {reply.text[:200]}")
                continue
            latencies.append(time.perf_counter() - start)
            tokens += reply.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return {"requests": len(latencies), "errors": len(errors), "first_error": errors[0] if errors else None,
            "wall_s": round(wall, 2), "req_s": round(len(latencies) / wall, 3), "tok_s": round(tokens / wall, 1),
            "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99)}  # fmt: skip


def affinity(metrics: str, names: list[str]) -> dict[str, Any]:
    loads = per_replica(metrics, "loraserve_adapter_loads_total")
    served = per_replica(metrics, "loraserve_prompt_tokens_total")
    spread = [sum(1 for (_, model), v in served.items() if model == name and v > 0) for name in names]
    used = [n for n in spread if n]
    return {"loads_per_replica": sorted((int(v) for v in loads.values()), reverse=True),
            "loads_total": int(sum(loads.values())), "adapters_served": len(used),
            "replicas_per_adapter": round(sum(used) / len(used), 2) if used else None}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", type=Path, default=None, help="model directory (default: the default model)")
    add("--adapters", type=int, default=16, help="adapters in the stream's power-law draw (default 16)")
    add("--rank", type=int, default=8, help="adapter rank (default 8)")
    add("--alpha", type=float, default=0.5, help="power-law exponent (1: uniform; default 0.5)")
    add("--requests", type=int, default=256, help="requests in the stream (default 256)")
    add("--concurrency", type=int, default=8, help="clients, each sending its next request when answered")
    add("--prompt-len", type=int, nargs=2, default=(32, 256), help="prompt lengths drawn in [lo, hi)")
    add("--output-len", type=int, nargs=2, default=(16, 128), help="output lengths drawn in [lo, hi)")
    add("--seed", type=int, default=0)
    add("--json", type=Path, default=None, help="also write the results to this JSON file")
    add("--quick", action="store_true", help="a tiny random model, 6 adapters, 24 short requests")
    args = parse_with_quick(parser, argv, QUICK)
    import ray
    import torch
    from loraserve.api.server_thread import free_port
    from ray import serve
    from transformers import AutoConfig

    from loraserve.entrypoints.ray_serve import build_app
    from loraserve.entrypoints.serve import threads_per_replica
    from loraserve.models.loader import cache_root, default_model_dir

    work = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    if args.quick and args.model is None:
        args.model = make_model("tiny", default_model_dir(), work / "tiny", dtype=torch.float32, device="cpu")
    model = Path(args.model or default_model_dir())
    adapter_dir = work / "adapters" if args.quick else cache_root() / "bench-adapters" / f"replicas-{model.name}"
    adapters = make_adapters(model, adapter_dir, [args.rank] * args.adapters)
    names = [name for name, _ in adapters]
    vocab = AutoConfig.from_pretrained(model).vocab_size
    stream = make_stream(args.requests, tuple(args.prompt_len), tuple(args.output_len), vocab, rate=float("inf"),
                         cv=1.0, alpha=args.alpha, seed=args.seed)  # fmt: skip
    cpus = len(os.sched_getaffinity(0))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    results = []
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for phase, (label, replicas, routed) in enumerate(PHASES):
            options = {"registry": f"dir:{work / 'registry'}", "num_threads": threads_per_replica(cpus, replicas)}
            if args.quick:
                options |= {"kernels": "torch", "num_pages": 400}
            app = build_app(str(model), options, {"model_id": "base"}, replicas, route_by_adapter=routed)
            serve.run(app, name="bench", route_prefix="/")
            if phase == 0:
                for name, path in adapters:
                    files = [("files", (f, (path / f).read_bytes(), "application/octet-stream")) for f in FILES]
                    httpx.post(url + "/v1/adapters", data={"name": name}, files=files, timeout=600).raise_for_status()
            figures = asyncio.run(run_stream(url, stream, names, args.concurrency))
            figures |= affinity(httpx.get(url + "/metrics", timeout=60).text, names)
            results.append({"phase": label, "replicas": replicas, "routed_by_adapter": routed, **figures})
            print(json.dumps(results[-1]), flush=True)
            serve.delete("bench")  # the next phase starts with fresh replicas
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{args.requests} requests, {args.adapters} adapters (alpha {args.alpha}), concurrency "
          f"{args.concurrency}, {cpus} CPUs, model {model.name}\n")  # fmt: skip
    print("| phase | req/s | tok/s | p50 s | p99 s | adapter loads per replica | replicas per adapter | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        p50, p99 = (f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("latency_p50_s", "latency_p99_s"))
        print(f"| {r['phase']} | {r['req_s']} | {r['tok_s']} | {p50} | {p99} | {r['loads_per_replica']} | "
              f"{r['replicas_per_adapter']} | {r['errors']} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
