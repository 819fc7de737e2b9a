"""Two ``loraserve serve`` processes on one redis-server (issue 20's replica test, without Ray): an
adapter uploaded to the first is served by the second with the same greedy output; deleted on the
second, the first answers 404 for it within 5 s (the delete is published, not polled)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from adapter_factory import make_peft_adapter
from serve_process import start_serve

pytestmark = pytest.mark.slow


@pytest.fixture
def two_servers(tiny_model_dir: Path, redis_url: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    import redis

    url = redis_url.rsplit("/", 1)[0] + "/3"  # a database of its own in the session's redis-server
    redis.Redis.from_url(url).flushdb()
    options = ("--num-pages", "300", "--registry", url)
    processes: list[subprocess.Popen[bytes]] = []
    urls = []
    for name in ("a", "b"):
        process, url = start_serve(tiny_model_dir, tmp_path / f"{name}.log", *options)
        processes.append(process)
        urls.append(url)
    yield urls[0], urls[1]
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "The weather today", "max_tokens": 8, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_an_adapter_uploaded_on_one_server_is_served_and_deleted_on_the_other(
    two_servers: tuple[str, str], tiny_hf_model: Any, tmp_path: Path
) -> None:
    first, second = two_servers
    adapter = make_peft_adapter(tiny_hf_model, tmp_path / "shared", rank=4, target_modules=["q_proj", "v_proj"], seed=7)
    files = [("files", (name, (adapter / name).read_bytes())) for name in ("adapter_config.json",
                                                                          "adapter_model.safetensors")]  # fmt: skip
    uploaded = httpx.post(first + "/v1/adapters", data={"name": "shared"}, files=files, timeout=60)
    assert uploaded.status_code in (200, 201), uploaded.text
    on_first, on_second = complete(first, "shared"), complete(second, "shared")
    assert on_first.status_code == 200 and on_second.status_code == 200, (on_first.text, on_second.text)
    assert on_first.json()["choices"][0]["text"] == on_second.json()["choices"][0]["text"]
    base = complete(first, httpx.get(first + "/v1/models").json()["data"][0]["id"]).json()["choices"][0]["text"]
    assert base != on_first.json()["choices"][0]["text"]  # the adapter changes the output
    assert httpx.delete(second + "/v1/adapters/shared", timeout=60).status_code == 200
    deleted_at = time.monotonic()
    while (status := complete(first, "shared").status_code) != 404 and time.monotonic() - deleted_at < 5.0:
        time.sleep(0.02)
    assert status == 404, "the first server still served the adapter 5 s after its delete"
