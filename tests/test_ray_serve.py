"""loraserve on Ray Serve (``entrypoints/ray_serve.py``), with real local Ray instances.

First ``loraserve serve --ray-address local`` as a process, signalled as a process manager does:
SIGTERM drains the replica (the stream in flight finishes, new requests get 503) and it exits 0.
Then one ``ray.init(num_cpus=2)`` in this process (the module fixture): two engine replicas (the
tiny model) behind the ingress, one shared directory registry. The API answers as one process does,
the ingress refuses a body past the limits before it reads it whole, streams arrive chunk by chunk,
an adapter uploaded through the ingress is servable and deleted everywhere, requests for one adapter
stay on the replica that holds it (Serve's multiplexed routing; read from the merged ``/metrics``:
``loraserve_adapter_loads_total{replica}``), and a replica killed mid-run (``ray.kill`` on its
actor) is replaced while no request is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from adapter_factory import make_peft_adapter
from conftest import _free_port
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ROUTING_PROPAGATION_S = 5.0
BODY_LIMIT = 2**20  # the fixture's request body and upload limits
APP = "default"  # the fixture's serve.run application


def _per_replica(url: str, name: str, **labels: str) -> dict[str, float]:
    """``name{labels}``'s value per replica, from the ingress's merged ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {
        sample.labels["replica"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and {k: v for k, v in sample.labels.items() if k != "replica"} == labels
    }


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.1)


def _upload(url: str, tiny_hf_model: Any, path: Path, name: str, seed: int) -> None:
    adapter = make_peft_adapter(tiny_hf_model, path, rank=8, target_modules=["q_proj", "v_proj"], seed=seed)
    files = [("files", (n, (adapter / n).read_bytes(), "application/octet-stream")) for n in (CONFIG, WEIGHTS)]
    uploaded = httpx.post(url + "/v1/adapters", data={"name": name}, files=files, timeout=120)
    assert uploaded.status_code in (200, 201), uploaded.text


# ---- the serve command on its own Ray instance (runs first: no other Ray in this process yet) -------


def test_sigterm_drains_the_replicas_then_the_command_exits_0(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = _free_port()
    command = [sys.executable, "-m", "loraserve.entrypoints.cli", "serve", "--ray-address", "local",
               "--num-replicas", "1", "--model", str(tiny_model_dir), "--served-model-name", "base", "--port",
               str(port), "--kernels", "torch", "--num-pages", "400", "--num-threads", "1", "--registry",
               f"dir:{tmp_path / 'registry'}", "--shutdown-timeout", "60"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own instance, whatever runs here
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 (the process writes it until it exits)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def serving() -> bool:  # deployed (the log says so once serve.run returned) and answering
        if process.poll() is not None:
            pytest.fail(f"the command exited at start: {(tmp_path / 'serve.log').read_text()[-3000:]}")
        if "serving base with 1 replicas" not in (tmp_path / "serve.log").read_text():
            return False
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        _wait_for(serving, 180, "the command serving")
        first_chunk, outcome = threading.Event(), {}
        body = {"model": "base", "prompt": "Count with me:", "max_tokens": 1900, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    first_chunk.set()
                    if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                        outcome["finish_reason"] = chunk["choices"][0]["finish_reason"]
                    if chunk.get("usage"):
                        outcome["tokens"] = chunk["usage"]["completion_tokens"]

        streamer = threading.Thread(target=stream)
        streamer.start()
        assert first_chunk.wait(60)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _wait_for(lambda: httpx.get(url + "/health", timeout=10).status_code == 503, 20, "/health 503 (draining)")
        assert "finish_reason" not in outcome  # the drain began while the stream ran
        late = httpx.post(url + "/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert late.status_code == 503 and "shutting down" in late.text, late.text
        assert late.json()["error"]["code"] == 503
        streamer.join(120)
        assert outcome == {"finish_reason": "length", "tokens": 1900}
        assert process.wait(90) == 0
        assert time.monotonic() - signalled < 90
        assert "replicas drained (0 request(s) ended early)" in (tmp_path / "serve.log").read_text()
    finally:
        if process.poll() is None:
            process.kill()  # its Ray processes share its fate
            process.wait()


# ---- two replicas in this process's Ray instance ----------------------------------------------------


@pytest.fixture(scope="module")
def url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from loraserve.entrypoints.ray_serve import build_app

    registry = tmp_path_factory.mktemp("ray-registry")
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = {"registry": f"dir:{registry}", "kernels": "torch", "num_pages": 200, "num_threads": 1}
        settings = {"model_id": "base", "max_request_body_bytes": BODY_LIMIT, "max_upload_bytes": BODY_LIMIT}
        serve.run(build_app(str(tiny_model_dir), options, settings, num_replicas=2), name=APP, route_prefix="/")
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


def test_the_ingress_refuses_a_body_past_the_limits_before_it_reads_it_whole(url: str) -> None:
    """413 from the ingress itself (no replica header): announced, chunked, and an upload past its
    own limit plus the multipart framing; then the next request is served."""
    oversized = json.dumps({"model": "base", "prompt": "x" * (BODY_LIMIT + 1)}).encode()
    announced = httpx.post(url + "/v1/completions", content=oversized, timeout=60,
                           headers={"content-type": "application/json"})  # fmt: skip
    chunked = httpx.post(url + "/v1/completions", content=iter([oversized[:1000], oversized[1000:]]), timeout=60,
                         headers={"content-type": "application/json"})  # fmt: skip
    upload = httpx.post(url + "/v1/adapters", data={"name": "huge"}, timeout=60,
                        files=[("files", (WEIGHTS, b"\0" * (2 * BODY_LIMIT), "application/octet-stream"))])  # fmt: skip
    for reply, limit in ((announced, BODY_LIMIT), (chunked, BODY_LIMIT), (upload, BODY_LIMIT)):
        assert reply.status_code == 413 and "x-loraserve-replica" not in reply.headers, reply.text
        assert reply.json()["error"]["code"] == 413 and f"{limit} bytes" in reply.json()["error"]["message"]
    assert "content-length" not in chunked.request.headers  # sent chunked: counted while it arrives
    body = {"model": "base", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    assert httpx.post(url + "/v1/completions", json=body, timeout=120).status_code == 200


def test_metrics_of_every_replica_through_the_ingress(url: str) -> None:
    reply = httpx.get(url + "/metrics", timeout=30)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    up = _per_replica(url, "loraserve_replica_up")
    assert len(up) == 2 and set(up.values()) == {1.0}, up
    assert set(_per_replica(url, "loraserve_pool_pages", kind="total")) == set(up)
    assert reply.text.count("# TYPE loraserve_adapter_loads_total counter") == 1


def test_an_adapter_uploaded_once_is_served_and_deleted_everywhere(
    url: str, tiny_hf_model: Any, tmp_path: Path
) -> None:
    _upload(url, tiny_hf_model, tmp_path / "a", "shared", seed=3)
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
    # loaded once, there only (the counter each replica's API exports, merged by the ingress)
    (holder,) = replicas
    loads = _per_replica(url, "loraserve_adapter_loads_total")
    assert loads == {replica: float(replica == holder) for replica in loads} and len(loads) == 2, loads
    assert httpx.delete(url + "/v1/adapters/shared", timeout=60).status_code == 200
    gone = [httpx.post(url + "/v1/completions", json=body, timeout=120).status_code for _ in range(4)]
    assert gone == [404] * 4


def test_a_killed_replica_is_replaced_while_no_request_is_lost(url: str, tiny_hf_model: Any, tmp_path: Path) -> None:
    from loraserve.entrypoints.fleet_metrics import replica_actor_name

    _upload(url, tiny_hf_model, tmp_path / "s", "survivor", seed=5)  # registered before the kill
    short = {"model": "survivor", "prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    first = httpx.post(url + "/v1/completions", json=short, timeout=120)
    assert first.status_code == 200, first.text
    expected, victim = first.json()["choices"][0]["text"], first.headers["x-loraserve-replica"]
    before = set(_per_replica(url, "loraserve_replica_up"))
    assert victim in before and len(before) == 2
    time.sleep(ROUTING_PROPAGATION_S)  # so the long request below goes to the victim, which holds the adapter

    results: list[Any] = []
    stop = threading.Event()

    def base_load() -> None:  # short requests one after another, all through the kill
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                try:
                    reply = client.post(url + "/v1/completions", json={**short, "model": "base"})
                    results.append(reply.status_code)
                except httpx.HTTPError as error:  # a hang ends as a timeout here, and fails the test
                    results.append(repr(error))

    with ThreadPoolExecutor(4) as pool:
        long = pool.submit(httpx.post, url + "/v1/completions", json={**short, "max_tokens": 1000}, timeout=120)
        _wait_for(lambda: _per_replica(url, "loraserve_requests_running").get(victim, 0) == 1, 30,
                  "the long request running on the victim")  # fmt: skip
        loaders = [pool.submit(base_load) for _ in range(2)]
        time.sleep(0.5)
        name = replica_actor_name(APP, "EngineReplica", victim)
        ray.kill(ray.get_actor(name, namespace="serve"))
        killed = time.monotonic()
        after = [httpx.post(url + "/v1/completions", json=short, timeout=60) for _ in range(3)]
        answered = long.result(timeout=120)
        time.sleep(1.0)
        stop.set()
        for loader in loaders:
            loader.result(timeout=90)
    # the request that was running on the killed replica was sent again, to the other one, and finished
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["completion_tokens"] == 1000
    assert answered.headers["x-loraserve-replica"] != victim
    # the adapter registered before the kill: served by the other replica from the shared registry
    assert [(r.status_code, r.json()["choices"][0]["text"]) for r in after] == [(200, expected)] * 3
    assert all(r.headers["x-loraserve-replica"] != victim for r in after)
    assert results and set(results) == {200}, results  # no request lost, none hung
    resent = _per_replica_free(url, "loraserve_ingress_resent_requests_total")
    assert resent >= 1
    # Serve starts a replacement; then both replicas answer again
    _wait_for(lambda: len([r for r, v in _per_replica(url, "loraserve_replica_up").items() if v == 1]) == 2, 90,
              "a replacement replica")  # fmt: skip
    now = {r for r, v in _per_replica(url, "loraserve_replica_up").items() if v == 1}
    assert victim not in now
    print(f"replaced in {time.monotonic() - killed:.1f} s; {len(results)} requests in the kill, {resent:.0f} resent")
    seen: set[str] = set()
    body = {**short, "model": "base"}
    with ThreadPoolExecutor(4) as pool:
        for _ in range(10):
            replies = list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=60), range(8)))
            assert all(r.status_code == 200 for r in replies)
            seen |= {r.headers["x-loraserve-replica"] for r in replies}
            if seen == now:
                break
    assert seen == now


def _per_replica_free(url: str, name: str) -> float:
    """A sample of the ingress's own (no replica label)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    assert len(values) == 1, (name, values)
    return values[0]


def test_a_replica_whose_engine_loop_stopped_is_replaced(url: str) -> None:
    """Serve's health check asks the replica (``EngineReplica.check_health``); its actor answering,
    and its API's ``/metrics``, are not enough: its engine no longer serves."""
    from loraserve.entrypoints.fleet_metrics import replica_actor_name

    def up() -> set[str]:
        return {r for r, v in _per_replica(url, "loraserve_replica_up").items() if v == 1}

    def stop_engine_loop(replica_actor: Any) -> bool:  # in the replica's actor (a nested function: sent by value)
        try:  # Serve's private attributes (Ray 2.60): the replica object
            replica = replica_actor._replica_impl._user_callable_wrapper._callable
        except AttributeError:
            return False
        replica.async_engine.shutdown()
        return True

    before = up()
    assert len(before) == 2
    victim = min(before)
    actor = ray.get_actor(replica_actor_name(APP, "EngineReplica", victim), namespace="serve")
    if not ray.get(actor.__ray_call__.remote(stop_engine_loop), timeout=60):
        pytest.skip("this Ray's replica actor keeps the deployment's object elsewhere (its private attributes)")
    _wait_for(lambda: victim not in (now := up()) and len(now) == 2, 90, "a replacement for the stopped engine")
    body = {"model": "base", "prompt": "Hello there", "max_tokens": 4}
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=60), range(8)))
    assert [r.status_code for r in replies] == [200] * 8


def test_the_health_check_fails_once_the_engine_loop_or_the_api_thread_has_stopped() -> None:
    import threading
    from types import SimpleNamespace

    from loraserve.entrypoints.ray_serve import EngineReplica

    check = EngineReplica.func_or_class.check_health
    alive, stopped = threading.Thread(target=time.sleep, args=(30,), daemon=True), threading.Thread(target=int)
    alive.start()
    stopped.start()
    stopped.join()

    def replica(engine_running: bool, thread: threading.Thread) -> Any:
        engine = SimpleNamespace(is_running=engine_running, draining=True)
        return SimpleNamespace(async_engine=engine, server=SimpleNamespace(thread=thread), replica_id="r")

    check(replica(True, alive))  # draining, serving what it has: healthy
    with pytest.raises(RuntimeError, match="engine loop has stopped"):
        check(replica(False, alive))
    with pytest.raises(RuntimeError, match="API server thread has stopped"):
        check(replica(True, stopped))


def test_replicas_on_one_machine_share_its_cores() -> None:
    from loraserve.entrypoints.serve import threads_per_replica

    assert [threads_per_replica(16, n) for n in (1, 2, 3, 4, 32)] == [16, 8, 5, 4, 1]


def test_each_replica_on_cuda_holds_a_gpu_of_its_own() -> None:
    from loraserve.entrypoints.ray_serve import replica_actor_options

    assert replica_actor_options("cpu") == {"num_cpus": 0}
    assert replica_actor_options("cuda") == {"num_cpus": 0, "num_gpus": 1}
    with pytest.raises(ValueError, match="each replica gets its own GPU"):
        replica_actor_options("cuda:1")
