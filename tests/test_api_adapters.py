"""Adapter management over HTTP on a real uvicorn server: uploads (files and archives) and every
bad case, listing, deletion, the vLLM-compatible load/unload with path confinement, and
inference through an adapter. Skipped until the engine exposes its adapter registry."""

from __future__ import annotations

import dataclasses
import io
import os
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from adapter_factory import make_peft_adapter_for_config, tiny_llama_config
from loraserve.api import ServerSettings, ServerThread, create_app

from loraserve.config import EngineConfig
from loraserve.llm_engine import LLMEngine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not hasattr(LLMEngine, "register_adapter"), reason="waits on LLMEngine.register_adapter/remove_adapter"
    ),
]

MODEL = "smol"
PROMPT = "The capital of France is"
MAX_UPLOAD = 4 * 2**20
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


@dataclasses.dataclass
class Server:
    url: str
    engine: LLMEngine
    http: httpx.Client
    client: openai.OpenAI
    allowed: Path
    outside: Path


def engine_config(tmp: Path, **options: Any) -> EngineConfig:
    fields = {field.name for field in dataclasses.fields(EngineConfig)}
    if "registry" in fields:
        options["registry"] = f"dir:{tmp / 'registry'}"
    return EngineConfig(num_pages=128, max_num_seqs=8, max_num_batched_tokens=512, **options)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("api_adapters")
    allowed, outside = tmp / "allowed", tmp / "outside"
    allowed.mkdir()
    outside.mkdir()
    engine = LLMEngine(engine_config(tmp))
    settings = ServerSettings(model_id=MODEL, allowed_lora_dirs=(str(allowed),), max_upload_bytes=MAX_UPLOAD)
    with ServerThread(create_app(engine, settings)) as running, httpx.Client(base_url=running.url, timeout=120) as http:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield Server(running.url, engine, http, client, allowed, outside)


def adapter_files(server: Server, directory: Path, seed: int, rank: int = 8) -> dict[str, bytes]:
    path = make_peft_adapter_for_config(
        server.engine.hf_config, directory, rank=rank, target_modules=["q_proj", "v_proj"], seed=seed
    )
    return {CONFIG: (path / CONFIG).read_bytes(), WEIGHTS: (path / WEIGHTS).read_bytes()}


def upload(server: Server, name: str | None, files: dict[str, bytes]) -> httpx.Response:
    parts = [("files", (file_name, data, "application/octet-stream")) for file_name, data in files.items()]
    return server.http.post("/v1/adapters", data={} if name is None else {"name": name}, files=parts)


def zipped(files: dict[str, bytes], folder: str = "") -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(folder + name, data)
    return buffer.getvalue()


def tarred(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(f"my-adapter/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def assert_error(response: httpx.Response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status  # vLLM's: the HTTP status
    for word in words:
        assert word in error["message"], error["message"]


def adapter_names(server: Server) -> set[str]:
    return {card["id"] for card in server.http.get("/v1/adapters").json()["data"]}


def first_token_logprob(server: Server, model: str) -> float:
    result = server.client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs
    value = logprobs.token_logprobs[0]
    assert value is not None
    return value


def test_upload_list_use_delete(server: Server, tmp_path: Path) -> None:
    files = adapter_files(server, tmp_path / "a", seed=1)
    response = upload(server, "alpha", files)
    assert response.status_code == 201, response.text
    card = response.json()
    assert card["id"] == "alpha" and card["rank"] == 8 and card["digest"]
    assert set(card["target_modules"]) == {"q_proj", "v_proj"} and card["num_bytes"] > 0
    assert card["num_parameters"] > 0
    assert "alpha" in adapter_names(server)
    assert server.http.get("/v1/adapters/alpha").json()["digest"] == card["digest"]
    models = {model.id: model for model in server.client.models.list()}
    assert {MODEL, "alpha"} <= set(models) and models["alpha"].parent == MODEL  # type: ignore[attr-defined]
    assert models[MODEL].max_model_len == server.engine.max_model_len  # type: ignore[attr-defined]
    assert models["alpha"].max_model_len is None  # type: ignore[attr-defined]
    assert first_token_logprob(server, "alpha") != pytest.approx(first_token_logprob(server, MODEL), abs=1e-5)
    chat = server.client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )
    assert chat.model == "alpha" and chat.choices[0].message.content is not None
    assert_error(upload(server, "alpha", files), 409, "alpha")
    assert_error(upload(server, MODEL, files), 409, "base model")
    assert server.http.delete("/v1/adapters/alpha").json() == {"id": "alpha", "object": "adapter", "deleted": True}
    assert_error(server.http.get("/v1/adapters/alpha"), 404)
    assert_error(server.http.delete("/v1/adapters/alpha"), 404)
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="alpha", prompt=PROMPT, max_tokens=1)


def test_archives_upload_with_the_same_digest(server: Server, tmp_path: Path) -> None:
    files = adapter_files(server, tmp_path / "b", seed=2)
    by_zip = upload(server, "zipped", {"adapter.zip": zipped(files, folder="adapter/")})
    by_tar = upload(server, "tarred", {"adapter.tar.gz": tarred(files)})
    assert by_zip.status_code == 201 and by_tar.status_code == 201, (by_zip.text, by_tar.text)
    assert by_zip.json()["digest"] == by_tar.json()["digest"]
    for name in ("zipped", "tarred"):
        assert server.http.delete(f"/v1/adapters/{name}").status_code == 200


def test_bad_uploads(server: Server, tmp_path: Path) -> None:
    files = adapter_files(server, tmp_path / "c", seed=3)
    assert_error(upload(server, None, files), 400, "name")
    assert_error(upload(server, "x", {}), 400)  # no files: httpx sends a urlencoded form
    assert_error(upload(server, "x", {CONFIG: files[CONFIG]}), 400, WEIGHTS)
    assert_error(upload(server, "x", {CONFIG: files[CONFIG], "adapter_model.bin": b"\x80\x04junk"}), 400, "pickle")
    assert_error(upload(server, "x", {**files, "extra.py": b"print(1)"}), 400, "extra.py")
    assert_error(upload(server, "x", {CONFIG: b"{not json", WEIGHTS: files[WEIGHTS]}), 400)
    assert_error(upload(server, "x", {CONFIG: files[CONFIG], WEIGHTS: b"not safetensors"}), 400)
    assert_error(upload(server, "../evil", files), 400)
    assert_error(upload(server, "a/b", files), 400)
    wrong_model = make_peft_adapter_for_config(
        tiny_llama_config(), tmp_path / "tiny", rank=4, target_modules=["q_proj"]
    )
    tiny = {name: (wrong_model / name).read_bytes() for name in (CONFIG, WEIGHTS)}
    assert upload(server, "tiny", tiny).status_code in (400, 422)
    assert_error(upload(server, "x", {"adapter.zip": zipped(files, folder="../")}), 400)
    assert_error(upload(server, "x", {"adapter.zip": b"PK\x03\x04 truncated"}), 400)
    assert_error(upload(server, "x", {"adapter.zip": zipped(files), CONFIG: files[CONFIG]}), 400)
    bomb = zipped({CONFIG: files[CONFIG], WEIGHTS: b"\0" * (MAX_UPLOAD + 1)})
    assert len(bomb) < MAX_UPLOAD
    assert_error(upload(server, "x", {"adapter.zip": bomb}), 413)
    assert_error(upload(server, "x", {CONFIG: files[CONFIG], WEIGHTS: os.urandom(MAX_UPLOAD + 1024)}), 413)
    not_multipart = server.http.post("/v1/adapters", json={"name": "x"})
    assert_error(not_multipart, 400, "multipart")
    assert not {"x", "tiny", "../evil", "a/b"} & adapter_names(server)


def test_load_and_unload_confined_to_allowed_dirs(server: Server) -> None:
    inside = server.allowed / "good"
    adapter_files(server, inside, seed=4)
    adapter_files(server, server.outside / "bad", seed=5)
    (server.allowed / "link").symlink_to(server.outside / "bad", target_is_directory=True)

    def load(name: str, path: str, **options: Any) -> httpx.Response:
        return server.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **options})

    response = load("good", str(inside))
    assert response.status_code == 200 and "good" in response.text
    first = server.http.get("/v1/adapters/good").json()["digest"]
    assert_error(load("good", str(inside)), 400, "load_inplace")  # vLLM's answer, a 400
    adapter_files(server, server.allowed / "better", seed=6)
    assert load("good", str(server.allowed / "better"), load_inplace=True).status_code == 200
    assert server.http.get("/v1/adapters/good").json()["digest"] != first  # replaced
    assert_error(load(MODEL, str(inside)), 400, "conflicts with a served base model")
    assert_error(load("moe", str(inside), is_3d_lora_weight=True), 400, "is_3d_lora_weight")
    assert_error(load("bad", str(server.outside / "bad")), 403, "outside")
    assert_error(load("bad", str(server.allowed / "link")), 403, "outside")
    assert_error(load("bad", "../outside/bad"), 403, "outside")
    assert_error(load("none", str(server.allowed / "missing")), 404)
    fifo = server.allowed / "fifo"  # opening a FIFO to read would wait for a writer forever
    fifo.mkdir()
    (fifo / CONFIG).write_bytes((inside / CONFIG).read_bytes())
    os.mkfifo(fifo / WEIGHTS)
    assert_error(load("fifo", str(fifo)), 400, "not a regular file")
    assert_error(server.http.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400, "lora_path")
    unload = server.http.post("/v1/unload_lora_adapter", json={"lora_name": "good"})
    assert unload.status_code == 200 and "good" in unload.text
    assert_error(server.http.post("/v1/unload_lora_adapter", json={"lora_name": "good"}), 404,
                 "The lora adapter 'good' cannot be found.")  # fmt: skip


def test_delete_while_in_flight(server: Server, tmp_path: Path) -> None:
    assert upload(server, "busy", adapter_files(server, tmp_path / "d", seed=6)).status_code == 201
    stream = server.client.completions.create(
        model="busy", prompt=PROMPT, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices
    assert server.http.delete("/v1/adapters/busy").status_code == 200
    try:
        rest = list(chunks)
    except openai.APIError as error:  # told why it stopped
        assert "busy" in str(error) or "abort" in str(error)
    else:  # or it finished on the weights it started with
        assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="busy", prompt=PROMPT, max_tokens=1)
    assert "busy" not in adapter_names(server)


def test_adapter_corrupted_in_the_store_is_a_named_error_and_the_server_keeps_serving(
    server: Server, tmp_path: Path
) -> None:
    """Files damaged after registration: the adapter's requests fail with a 400 naming it (JSON; a
    5xx would make clients retry what cannot succeed) or an error event (streamed); base-model
    requests go on."""
    assert upload(server, "damaged", adapter_files(server, tmp_path / "d", seed=21)).status_code == 201
    store_root = Path(server.engine.adapter_registry.store.root)
    ((store_root / "damaged").resolve() / WEIGHTS).write_bytes(b"not a safetensors file")
    body = {"model": "damaged", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    assert_error(server.http.post("/v1/completions", json=body), 400, "damaged", "could not be loaded")
    streamed = server.http.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 200 and "could not be loaded" in streamed.text and "damaged" in streamed.text
    ok = server.http.post("/v1/completions", json={**body, "model": MODEL})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_adapter_of_another_base_model_in_a_shared_store_is_a_400_not_listed(server: Server, tmp_path: Path) -> None:
    """A registry shared with a server of another model holds an adapter that does not fit this one:
    its requests get a 400 ``invalid_adapter`` naming the adapter and the misfit, JSON and streamed;
    it is not listed; its summary is a 400; the server goes on serving."""
    config = tiny_llama_config(num_layers=30)  # SmolLM2's layers, not its widths
    other = make_peft_adapter_for_config(config, tmp_path / "other", rank=4, target_modules=["q_proj"])
    files = {CONFIG: (other / CONFIG).read_bytes(), WEIGHTS: (other / WEIGHTS).read_bytes()}
    server.engine.adapter_registry.store.put("foreign", files)  # as that other server registered it
    try:
        body = {"model": "foreign", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        assert_error(server.http.post("/v1/completions", json=body), 400, "'foreign' could not be loaded", "shape")
        streamed = server.http.post("/v1/completions", json={**body, "stream": True})
        assert streamed.status_code == 200 and "could not be loaded" in streamed.text and '"code": 400' in streamed.text
        assert "foreign" not in adapter_names(server)
        assert_error(server.http.get("/v1/adapters/foreign"), 400, "foreign")
        ok = server.http.post("/v1/completions", json={**body, "model": MODEL})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    finally:
        server.engine.adapter_registry.store.delete("foreign")


def pool_metrics(server: Server) -> dict[tuple[str, str], float]:
    """(metric, kind label) -> value for the pool's metrics of /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    response = server.http.get("/metrics")
    assert response.status_code == 200
    return {
        (sample.name, sample.labels.get("kind", "")): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name.startswith(("loraserve_pool_", "loraserve_adapter_evictions"))
    }


def test_every_page_kind_is_in_metrics_and_an_adapter_eviction_is_counted(server: Server, tmp_path: Path) -> None:
    from loraserve.page_pool import EVICTABLE_KINDS, PageKind

    assert upload(server, "evicted", adapter_files(server, tmp_path / "evicted", seed=11)).status_code == 201
    before = pool_metrics(server)
    server.client.completions.create(model="evicted", prompt="Hello there", max_tokens=2, temperature=0)
    idle = pool_metrics(server)
    assert idle[("loraserve_pool_pages", "adapter_idle")] > 0  # the adapter stays resident, evictable
    # A base-model prompt that needs nearly every page of the pool reclaims the idle adapter.
    block_size, pages = server.engine.config.block_size, server.engine.pool.num_pages
    prompt = [100 + i % 5000 for i in range((pages - 2) * block_size)]  # all but the watermark page
    server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    after = pool_metrics(server)
    assert {kind.value for kind in PageKind} | {"total"} == {k for name, k in after if name == "loraserve_pool_pages"}
    assert {k for name, k in after if name == "loraserve_pool_evictions_total"} == {k.value for k in EVICTABLE_KINDS}
    evictions = ("loraserve_pool_evictions_total", "adapter_idle")  # this one and any earlier test's idle ones
    assert after[evictions] >= before[evictions] + 1 and after[("loraserve_pool_pages", "adapter_idle")] == 0
    adapter_evictions = ("loraserve_adapter_evictions_total", "")
    assert after[adapter_evictions] - before[adapter_evictions] == after[evictions] - before[evictions]
    assert sum(v for (name, k), v in after.items() if name == "loraserve_pool_pages" and k != "total") == pages


def test_max_tokens_lowered_to_the_pool_leaves_room_for_the_adapters_pages(server: Server, tmp_path: Path) -> None:
    """On a pool smaller than the context, a ``max_tokens`` past the pool is lowered to
    what the pool holds after the prompt and the adapter's pages, whether the adapter's size is
    known when the request arrives (the second request) or only once its files are read (the first)."""
    engine = server.engine
    assert engine.max_seq_tokens < engine.max_model_len  # the pool binds, not the context
    assert upload(server, "roomy", adapter_files(server, tmp_path / "r", seed=5)).status_code == 201
    prompt = [504] * (engine.max_seq_tokens - 200)  # any token id of the default model's vocabulary
    to_context = engine.max_model_len - len(prompt)  # past the pool
    body = {"model": "roomy", "prompt": prompt, "max_tokens": to_context, "temperature": 0, "ignore_eos": True}
    first = server.http.post("/v1/completions", json=body)
    assert first.status_code == 200, first.text
    pages = engine.adapters.num_pages(engine.adapters.resolver.resolve("roomy"))
    room = 200 - pages * engine.config.block_size
    assert pages > 0 and first.json()["usage"]["completion_tokens"] == room
    second = server.http.post("/v1/completions", json={**body, "max_tokens": 200})
    assert second.status_code == 200, second.text
    assert second.json()["usage"]["completion_tokens"] == room
    assert server.http.delete("/v1/adapters/roomy").status_code == 200
