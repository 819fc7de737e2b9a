"""API key and admin key on a real uvicorn server (the keyless case is test_api_completions)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from loraserve.api import ServerSettings, ServerThread, create_app

from loraserve.config import EngineConfig
from loraserve.llm_engine import LLMEngine

pytestmark = pytest.mark.slow

MODEL = "smol"
USER_KEY = "sk-user-0123456789"
ADMIN_KEY = "sk-admin-9876543210"
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    engine = LLMEngine(EngineConfig(num_pages=32, max_num_seqs=4, max_num_batched_tokens=256))
    settings = ServerSettings(model_id=MODEL, api_key=USER_KEY, admin_key=ADMIN_KEY)
    with ServerThread(create_app(engine, settings)) as running:
        yield running.url


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_auth_error(response: httpx.Response, status: int) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
        assert error["type"] == "Unauthorized" and error["code"] == 401


def test_open_endpoints(url: str) -> None:
    for path in ("/health", "/metrics", "/load", "/openapi.json", "/docs"):
        assert httpx.get(url + path).status_code == 200, path


def test_inference_needs_the_api_key(url: str) -> None:
    assert_auth_error(httpx.post(url + "/v1/completions", json=COMPLETION), 401)
    assert_auth_error(httpx.post(url + "/v1/completions", json=COMPLETION, headers=bearer("sk-wrong")), 401)
    assert_auth_error(httpx.get(url + "/v1/models", headers={"Authorization": USER_KEY}), 401)  # no scheme
    assert_auth_error(httpx.get(url + "/v1/adapters"), 401)
    assert_auth_error(httpx.post(url + "/invocations", json=COMPLETION), 401)  # SageMaker's route too
    batch = {"model": MODEL, "max_tokens": 1, "messages": [[{"role": "user", "content": "Hi"}]]}
    assert_auth_error(httpx.post(url + "/v1/chat/completions/batch", json=batch), 401)
    # Anthropic's routes also take the key in x-api-key, as Anthropic's clients send it.
    message = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    assert_auth_error(httpx.post(url + "/v1/messages", json=message), 401)
    assert_auth_error(httpx.post(url + "/v1/messages", json=message, headers={"x-api-key": "sk-wrong"}), 401)
    assert_auth_error(httpx.post(url + "/v1/completions", json=COMPLETION, headers={"x-api-key": USER_KEY}), 401)
    wrong_bearer = {**bearer("sk-wrong"), "x-api-key": USER_KEY}  # the bearer token is the one checked
    assert_auth_error(httpx.post(url + "/v1/messages", json=message, headers=wrong_bearer), 401)
    basic = {"Authorization": "Basic abc", "x-api-key": USER_KEY}  # not a bearer token: x-api-key is read
    for headers in ({"x-api-key": USER_KEY}, {"x-api-key": ADMIN_KEY}, bearer(USER_KEY), basic):
        assert httpx.post(url + "/v1/messages", json=message, headers=headers, timeout=60).status_code == 200
    for key in (USER_KEY, ADMIN_KEY):
        response = httpx.post(url + "/v1/completions", json=COMPLETION, headers=bearer(key), timeout=60)
        assert response.status_code == 200, response.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key=USER_KEY, max_retries=0, timeout=60)
    assert [model.id for model in client.models.list()] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert chat.choices[0].message.content is not None


def test_adapter_changes_need_the_admin_key(url: str) -> None:
    calls = [
        ("POST", "/v1/adapters", {"files": {"adapter_config.json": b"{}"}, "data": {"name": "x"}}),
        ("DELETE", "/v1/adapters/x", {}),
        ("POST", "/v1/load_lora_adapter", {"json": {"lora_name": "x", "lora_path": "/tmp"}}),
        ("POST", "/v1/unload_lora_adapter", {"json": {"lora_name": "x"}}),
    ]
    for method, path, kwargs in calls:
        assert_auth_error(httpx.request(method, url + path, **kwargs), 401)
        assert_auth_error(httpx.request(method, url + path, headers=bearer("sk-wrong"), **kwargs), 401)
        forbidden = httpx.request(method, url + path, headers=bearer(USER_KEY), **kwargs)
        assert_auth_error(forbidden, 403)
        assert "admin" in forbidden.json()["error"]["message"]
        admitted = httpx.request(method, url + path, headers=bearer(ADMIN_KEY), **kwargs)
        assert admitted.status_code not in (401, 403) or admitted.json()["error"]["param"] == "lora_path"


def test_adapter_key_falls_back_to_the_api_key() -> None:
    assert ServerSettings(model_id=MODEL, api_key="a", admin_key="b").adapter_key == "b"
    assert ServerSettings(model_id=MODEL, api_key="a").adapter_key == "a"
    assert ServerSettings(model_id=MODEL).adapter_key is None
    with pytest.raises(ValueError):
        ServerSettings(model_id=MODEL, api_key="")
