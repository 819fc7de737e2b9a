"""``/health`` and ``/metrics`` answer while the engine thread is busy with a long step (a CPU
prefill can take seconds; a probe gives up after one): with the last stats read, which the read
still waiting refreshes once the engine is free; an idle engine's are read at once."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
from loraserve.api import ServerSettings, ServerThread, create_app

from loraserve.config import EngineConfig
from loraserve.llm_engine import LLMEngine

pytestmark = pytest.mark.slow


def test_health_and_metrics_do_not_wait_out_a_long_step(tiny_model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_pages=64, kernels="torch"))
    app = create_app(engine, ServerSettings(model_id="tiny"))
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        idle = http.get("/health")
        assert idle.status_code == 200 and idle.json()["kernels"]  # read at once
        served = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3})
        assert served.status_code == 200
        async_engine = app.state.server.async_engine
        busy = threading.Thread(target=lambda: asyncio.run(async_engine.call(lambda _: time.sleep(8))))
        busy.start()  # the engine thread is taken for 8 s, as by a long step
        time.sleep(0.3)
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["kernels"] == idle.json()["kernels"]
        metrics = http.get("/metrics")
        assert metrics.status_code == 200 and "loraserve_requests_running 0.0" in metrics.text
        assert busy.is_alive()  # both answered while the engine thread was still taken
        busy.join()
        assert http.get("/health").status_code == 200
