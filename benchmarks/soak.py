"""Soak: a server under mixed load with cancellations and adapter churn, for a set duration.

    python -m benchmarks.soak --duration 600                       # starts `loraserve serve` (default model)
    python -m benchmarks.soak --url http://127.0.0.1:8000 --admin-key KEY   # an already running server

``--clients`` concurrent clients (64) loop until ``--duration`` seconds are up, each request on
the base model or one of ``--adapters`` uploaded adapters (ranks 8-64), streamed or not, prompts
of 4-256 random tokens, 4-64 new tokens; ``--cancel`` of them (10 %) are cut by the client at a
random point (a streamed one after a few chunks, a plain one by a short timeout). Meanwhile an
admin task uploads a new adapter and deletes an older one every few seconds, while requests use
them. It reports requests served, errors by kind (an error event inside a stream and a reply that
is not the API's JSON included; a 404 for an adapter the churn deleted after the client picked it
is the client's race, counted apart as ``raced_deletes``), completion tokens (from usage), p50/p99
TTFT of the streamed requests and latency of the plain ones (interpolated as vLLM's ``bench
serve`` does), silent drops (a stream that ended without a finish reason, or a 200 without its
choices, that the client did not cut), the server's memory (RSS after a quarter of the run, at
the end, and its peak, when it started the server), and whether the server came back to idle:
nothing running or waiting, every pool page free or evictable cache, ``/health`` 200; and, when it
started the server, whether SIGTERM stopped it with exit code 0 (and in how long). Exit status 1
when any of those fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks._arrivals import percentile

RANKS = (8, 16, 32, 64)


@dataclass
class Tally:
    served: int = 0
    cancelled: int = 0
    silent_drops: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    ttfts: list[float] = field(default_factory=list)  # seconds to a stream's first chunk
    latencies: list[float] = field(default_factory=list)  # seconds to a plain request's answer
    tokens: int = 0  # completion tokens of the requests served (from usage)
    uploads: int = 0
    deletes: int = 0
    deleted: set[str] = field(default_factory=set)  # adapters the churn task deleted
    raced_deletes: int = 0  # 404s for an adapter deleted after the client picked it: expected

    def refused(self, model: str, status: int) -> None:
        """Count a non-200 answer: an error, unless it is the 404 of a request that raced the
        delete of its adapter (the client picked it, then the churn task deleted it)."""
        if status == 404 and model in self.deleted:
            self.raced_deletes += 1
        else:
            self.errors[f"http {status}"] += 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--model", default=None, help="model directory for the server it starts (default model)")
    parser.add_argument("--admin-key", default=None, help="the server's admin key, if it has one")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (60)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (64)")
    parser.add_argument("--adapters", type=int, default=4, help="adapters uploaded at the start (4)")
    parser.add_argument("--cancel", type=float, default=0.1, help="share of requests the client cuts (0.1)")
    parser.add_argument("--churn-every", type=float, default=5.0, help="seconds between adapter uploads/deletes (5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--server-arg", action="append", default=[], help="extra argument for `loraserve serve`")
    return parser.parse_args(argv)


def start_server(args: argparse.Namespace, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = 18000 + random.Random(os.getpid()).randrange(1000)
    command = [sys.executable, "-m", "loraserve.entrypoints.cli", "serve", "--port", str(port),
               "--registry", f"dir:{workdir / 'registry'}", "--log-level", "warning", *args.server_arg]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 (the server writes it until it exits)
    # PYTHONFAULTHANDLER: a server that hangs at stop dumps every thread's stack on SIGABRT.
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONFAULTHANDLER": "1"}
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited at start: {(workdir / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not start")


def rss_mib(pid: int, field_name: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def adapter_files(model_dir: Path, workdir: Path, index: int) -> list[tuple[str, tuple[str, bytes, str]]]:
    from benchmarks._random_models import make_adapters

    ((_, path),) = make_adapters(model_dir, workdir / f"adapter{index}", [RANKS[index % len(RANKS)]])
    return [("files", (name, (path / name).read_bytes(), "application/octet-stream"))
            for name in ("adapter_config.json", "adapter_model.safetensors")]  # fmt: skip


async def one_request(client: httpx.AsyncClient, rng: random.Random, model: str, vocab: int, cancel: float,
                      tally: Tally) -> None:  # fmt: skip
    prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(4, 256))]
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": rng.randint(4, 64), "ignore_eos": True,
                            "temperature": rng.choice([0, 0.8])}  # fmt: skip
    stream = rng.random() < 0.5
    cut = rng.random() < cancel
    start = time.monotonic()
    try:
        if stream:
            body["stream"], body["stream_options"] = True, {"include_usage": True}
            cut_after = rng.randint(1, 4)
            finish, chunks, tokens = None, 0, None
            async with client.stream("POST", "/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    tally.refused(model, reply.status_code)
                    return
                async for line in reply.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:  # the server's error event after the stream started
                        tally.errors[f"stream error {event['error'].get('code')}"] += 1
                        return
                    chunks += 1
                    if chunks == 1:
                        tally.ttfts.append(time.monotonic() - start)
                    choice = event["choices"]
                    finish = (choice[0].get("finish_reason") if choice else None) or finish
                    tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
                    if cut and chunks >= cut_after:
                        tally.cancelled += 1
                        return  # leaving the block closes the stream: the server must abort the request
            if finish is None:
                tally.silent_drops += 1
            elif tokens is None:
                tally.errors["stream without usage"] += 1
            else:
                tally.served += 1
                tally.tokens += tokens
        else:
            timeout = rng.uniform(0.05, 1.0) if cut else 600
            try:
                reply = await client.post("/v1/completions", json=body, timeout=timeout)
            except httpx.TimeoutException:
                if cut:
                    tally.cancelled += 1
                    return
                raise
            if reply.status_code != 200:
                tally.refused(model, reply.status_code)
                return
            answer = reply.json()
            if not answer.get("choices") or answer["choices"][0].get("finish_reason") is None:
                tally.silent_drops += 1
                return
            tokens = answer["usage"]["completion_tokens"]
            tally.latencies.append(time.monotonic() - start)
            tally.served += 1
            tally.tokens += tokens
    except httpx.HTTPError as error:
        tally.errors[type(error).__name__] += 1
    except (ValueError, KeyError, TypeError, AttributeError) as error:  # a body that is not the API's JSON
        tally.errors[f"bad reply {type(error).__name__}"] += 1


async def client_loop(url: str, models: list[str], deadline: float, seed: int, vocab: int, cancel: float,
                      tally: Tally) -> None:  # fmt: skip
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        while time.monotonic() < deadline:
            await one_request(client, rng, rng.choice(models), vocab, cancel, tally)


async def churn(url: str, headers: dict[str, str], model_dir: Path, workdir: Path, first: int, deadline: float,
                every: float, tally: Tally, models: list[str]) -> None:  # fmt: skip
    """Upload a new adapter and delete an older uploaded one, every ``every`` seconds."""
    index = first
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=headers) as client:
        while time.monotonic() + every < deadline:
            await asyncio.sleep(every)
            files = await asyncio.to_thread(adapter_files, model_dir, workdir, index)
            reply = await client.post("/v1/adapters", data={"name": f"churn{index}"}, files=files)
            if reply.status_code in (200, 201):
                tally.uploads += 1
                models.append(f"churn{index}")
            else:
                tally.errors[f"upload http {reply.status_code}"] += 1
            churned = [m for m in models if m.startswith("churn")]
            if len(churned) > 2:  # in use by running requests, maybe: they must finish on it
                victim = churned[0]
                models.remove(victim)
                tally.deleted.add(victim)
                deleted = await client.delete(f"/v1/adapters/{victim}")
                tally.deletes += deleted.status_code == 200
                if deleted.status_code != 200:
                    tally.errors[f"delete http {deleted.status_code}"] += 1
            index += 1


def idle_state(url: str, timeout: float = 60) -> dict[str, Any]:
    """Wait for nothing running or waiting; then the pool's pages by kind and /health."""
    deadline = time.monotonic() + timeout
    while True:
        values: dict[str, float] = {}
        for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        queued = values.get("loraserve_requests_running", 0) + values.get("loraserve_requests_waiting", 0)
        if queued == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    pages = {name.split('"')[1]: value for name, value in values.items() if name.startswith("loraserve_pool_pages{")}
    total = pages.get("total", 0)
    busy = pages.get("kv", 0) + pages.get("adapter", 0)
    health = httpx.get(url + "/health", timeout=30).status_code
    return {"queued": queued, "pages": pages, "idle": queued == 0 and busy == 0 and total > 0, "health": health}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.throughput import machine_info
    from loraserve.models.loader import default_model_dir

    workdir = Path(tempfile.mkdtemp(prefix="loraserve-soak-"))
    model_dir = Path(args.model) if args.model else default_model_dir()
    process, url = (None, args.url) if args.url else start_server(args, workdir)
    headers = {"Authorization": f"Bearer {args.admin_key}"} if args.admin_key else {}
    try:
        vocab = min(int(json.loads((model_dir / "config.json").read_text())["vocab_size"]), 30000)
        models = [httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]]
        for index in range(args.adapters):
            reply = httpx.post(url + "/v1/adapters", data={"name": f"soak{index}"}, headers=headers, timeout=600,
                               files=adapter_files(model_dir, workdir, index))  # fmt: skip
            if reply.status_code not in (200, 201) and "exists" not in reply.text:
                raise SystemExit(f"adapter upload failed: {reply.status_code} {reply.text}")
            models.append(f"soak{index}")
        warm = httpx.post(url + "/v1/completions", json={"model": models[-1], "prompt": "Hi", "max_tokens": 4})
        warm.raise_for_status()
        tally = Tally()
        deadline = time.monotonic() + args.duration
        rss: dict[str, float] = {}

        async def sample_memory() -> None:  # after a quarter of the run: the warmed-up size
            await asyncio.sleep(args.duration / 4)
            if process:
                rss["after_warm_up"] = round(rss_mib(process.pid), 1)

        async def load() -> None:
            tasks = [client_loop(url, models, deadline, args.seed + i, vocab, args.cancel, tally)
                     for i in range(args.clients)]  # fmt: skip
            tasks.append(churn(url, headers, model_dir, workdir, args.adapters, deadline, args.churn_every, tally,
                               models))  # fmt: skip
            tasks.append(sample_memory())
            await asyncio.gather(*tasks)

        started = time.monotonic()
        asyncio.run(load())
        elapsed = time.monotonic() - started
        state = idle_state(url)
        report: dict[str, Any] = {
            "machine": machine_info(),
            "duration_s": round(elapsed, 1),
            "clients": args.clients,
            "served": tally.served,
            "cancelled_by_client": tally.cancelled,
            "silent_drops": tally.silent_drops,
            "errors": dict(tally.errors),
            "server_errors_5xx": sum(n for kind, n in tally.errors.items() if kind.split()[-1].startswith("5")),
            "tokens": tally.tokens,
            "tok_per_s": round(tally.tokens / elapsed, 1),
            **{
                f"{name}_p{q}_s": rounded(percentile(values, q))
                for name, values in (("ttft", tally.ttfts), ("latency", tally.latencies))
                for q in (50, 99)
            },
            "adapter_uploads": tally.uploads,
            "adapter_deletes": tally.deletes,
            "raced_deletes": tally.raced_deletes,
            "after": state,
        }
        if process:
            report["rss_mib"] = {**rss, "end": round(rss_mib(process.pid), 1),
                                 "peak": round(rss_mib(process.pid, "VmHWM"), 1)}  # fmt: skip
            report["shutdown"] = stop_server(process, workdir)
        report["ok"] = (report["silent_drops"] == 0 and report["server_errors_5xx"] == 0 and not tally.errors
                        and state["idle"] and state["health"] == 200 and tally.served > 0
                        and report.get("shutdown", {}).get("exit_code", 0) == 0)  # fmt: skip
        return report
    finally:
        if process and process.poll() is None:
            process.kill()
            process.wait()


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def stop_server(process: subprocess.Popen[bytes], workdir: Path, timeout: float = 90) -> dict[str, Any]:
    """SIGTERM, as a user stops it: its exit code and how long it took; when it has not exited
    within ``timeout`` seconds, SIGABRT (its threads' stacks go to its log), exit code None and the
    end of its log."""
    started = time.monotonic()
    process.terminate()
    try:
        code: int | None = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        code = None
    result: dict[str, Any] = {"exit_code": code, "seconds": round(time.monotonic() - started, 1)}
    if code != 0:
        result["log_tail"] = (workdir / "server.log").read_text(errors="replace")[-8000:]
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
