"""The soak's CI version (``benchmarks/soak.py``): a real server (the tiny model) for 60 s under
64 clients with streamed and plain requests on the base model and adapters, 10 % cut by the client
at random points, adapters uploaded and deleted while in use; then no silent drop, no error of any
kind, the server healthy and back to idle (nothing queued, no page held), and it stops on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import httpx
import pytest

from benchmarks import soak


def test_soak_client_counts_error_events_and_bad_replies() -> None:
    """An error event inside a stream, a stream without usage, and a 200 that is not the API's JSON
    are counted as errors by kind: the soak goes on and reports them (it raised before)."""
    replies = iter(["error", "no-usage", "garbage"] * 20)

    def answer(request: httpx.Request) -> httpx.Response:
        streamed = json.loads(request.content).get("stream", False)
        kind = next(replies)
        if not streamed:
            no_usage = '{"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}'
            return httpx.Response(200, text="{not json" if kind == "garbage" else no_usage)
        if kind == "error":
            body = 'data: {"error": {"message": "boom", "code": 500}}\n\n'
        else:
            chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
            body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def run() -> soak.Tally:
        tally = soak.Tally()
        rng = random.Random(0)
        async with httpx.AsyncClient(base_url="http://soak.test", transport=httpx.MockTransport(answer)) as client:
            for _ in range(40):
                await soak.one_request(client, rng, "base", 1000, 0.0, tally)
        return tally

    tally = asyncio.run(run())
    assert tally.served == 0 and tally.silent_drops == 0
    assert tally.errors["stream error 500"] > 0 and tally.errors["stream without usage"] > 0, tally.errors
    assert tally.errors["bad reply JSONDecodeError"] > 0 and tally.errors["bad reply KeyError"] > 0, tally.errors
    assert sum(tally.errors.values()) == 40


@pytest.mark.slow
def test_soak_60_seconds(tiny_model_dir: Path) -> None:
    args = soak.parse_args(["--model", str(tiny_model_dir), "--duration", "60", "--clients", "64", "--adapters", "4",
                            "--server-arg=--num-pages=600"])  # fmt: skip
    report = soak.run(args)
    assert report["silent_drops"] == 0 and report["errors"] == {}, report
    assert report["served"] > 100 and report["cancelled_by_client"] > 5, report
    assert report["tokens"] >= 4 * report["served"], report  # every served request made at least 4 (usage)
    assert report["ttft_p50_s"] > 0 and report["latency_p50_s"] > 0, report
    assert report["adapter_uploads"] >= 5 and report["adapter_deletes"] >= 3, report
    assert report["after"]["idle"] and report["after"]["health"] == 200, report["after"]
    assert report["shutdown"]["exit_code"] == 0, report["shutdown"]
    assert report["ok"]
