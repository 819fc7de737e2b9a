"""loraserve on Ray Serve (``entrypoints/ray_serve.py``), with a real local Ray instance
(``ray.init(num_cpus=2)``): two engine replicas (the tiny model) behind the ingress, one shared
directory registry. The API answers as one process does, streams arrive chunk by chunk, an
adapter uploaded through the ingress is servable and deleted everywhere, and requests for one
adapter stay on the replica that holds it (Serve's multiplexed routing)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from adapter_factory import make_peft_adapter

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ROUTING_PROPAGATION_S = 5.0


@pytest.fixture(scope="module")
def url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from conftest import _free_port

    from loraserve.entrypoints.ray_serve import build_app

    registry = tmp_path_factory.mktemp("ray-registry")
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = {"registry": f"dir:{registry}", "kernels": "torch", "num_pages": 200, "num_threads": 1}
        settings = {"model_id": "base"}
        serve.run(build_app(str(tiny_model_dir), options, settings, num_replicas=2), route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_the_api_through_the_ingress(url: str) -> None:
    body = {"model": "base", "prompt": "Hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 5, plain.text
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1] if json.loads(e[6:])["choices"])
    assert text == plain.json()["choices"][0]["text"]
    bad = httpx.post(url + "/v1/completions", json={**body, "n": 0}, timeout=120)
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(url + "/health", timeout=60).status_code == 200
    assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=60).json()["data"]] == ["base"]


def test_an_adapter_uploaded_once_is_served_and_deleted_everywhere(
    url: str, tiny_hf_model: Any, tmp_path: Path
) -> None:
    path = make_peft_adapter(tiny_hf_model, tmp_path / "a", rank=8, target_modules=["q_proj", "v_proj"], seed=3)
    files = [("files", (name, (path / name).read_bytes(), "application/octet-stream")) for name in (CONFIG, WEIGHTS)]
    uploaded = httpx.post(url + "/v1/adapters", data={"name": "shared"}, files=files, timeout=120)
    assert uploaded.status_code in (200, 201), uploaded.text
    body = {"model": "shared", "prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    base = httpx.post(url + "/v1/completions", json={**body, "model": "base"}, timeout=120).json()
    texts, replicas = set(), set()
    first = httpx.post(url + "/v1/completions", json=body, timeout=120)  # some replica takes the adapter
    assert first.status_code == 200, first.text
    texts.add(first.json()["choices"][0]["text"])
    time.sleep(ROUTING_PROPAGATION_S)  # replicas report the adapters they hold to Serve's routers
    for _ in range(6):
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        texts.add(reply.json()["choices"][0]["text"])
        replicas.add(reply.headers["x-loraserve-replica"])
    assert len(texts) == 1 and texts != {base["choices"][0]["text"]}  # the adapter changes the output
    assert len(replicas) == 1  # Serve keeps an adapter's requests on the replica that holds it
    assert httpx.delete(url + "/v1/adapters/shared", timeout=60).status_code == 200
    gone = [httpx.post(url + "/v1/completions", json=body, timeout=120).status_code for _ in range(4)]
    assert gone == [404] * 4
