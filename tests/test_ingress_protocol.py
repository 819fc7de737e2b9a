"""The Ray Serve ingress's own reading of requests and its stream-cut events, parsed by each API's
official client (no Ray needed: ``loraserve.entrypoints.ingress_protocol``)."""

import asyncio
import json
from types import ModuleType
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from loraserve.entrypoints.ingress_protocol import EventFramer, adapter_and_stream, may_resend, stream_cut_event

JSON = {"content-type": "application/json"}
SAGEMAKER = "x-amzn-sagemaker-adapter-identifier"


def test_the_adapter_is_the_bodys_model_or_on_invocations_the_sagemaker_header() -> None:
    body = json.dumps({"model": "sql", "prompt": "x", "stream": True}).encode()
    assert adapter_and_stream("/v1/completions", JSON, body, "base") == ("sql", True)
    assert adapter_and_stream("/v1/completions", JSON, json.dumps({"model": "base"}).encode(), "base") == ("", False)
    header = {**JSON, SAGEMAKER: "poems"}
    assert adapter_and_stream("/invocations", header, body, "base") == ("poems", True)
    assert adapter_and_stream("/invocations", {**JSON, SAGEMAKER: "base"}, body, "base") == ("", True)
    assert adapter_and_stream("/v1/completions", header, body, "base") == ("sql", True)  # only /invocations reads it
    assert adapter_and_stream("/invocations", JSON, body, "base") == ("sql", True)


@pytest.mark.parametrize(
    "headers, body",
    [
        ({"content-type": "text/plain"}, b'{"model": "sql"}'),
        (JSON, b""),
        (JSON, b'{"model": '),
        (JSON, b"[" * 100_000 + b"]" * 100_000),  # too deep for json: the replica answers the 400
        (JSON, b'["sql"]'),
        (JSON, b'{"model": 3, "stream": "maybe"}'),
    ],
)
def test_bodies_the_ingress_cannot_read_go_to_any_replica_unstreamed(headers: dict[str, str], body: bytes) -> None:
    assert adapter_and_stream("/v1/completions", headers, body, "base") == ("", False)


@pytest.mark.parametrize("value, streams", [(True, True), (1, True), ("true", True), ("yes", True), (False, False),
                                            (0, False), ("no", False), (None, False), ([], False)])  # fmt: skip
def test_a_stream_is_forwarded_as_one_whenever_the_replica_streams_it(value: Any, streams: bool) -> None:
    from loraserve.api.openai_protocol import CompletionRequest

    body = json.dumps({"model": "sql", "prompt": "x", "stream": value}).encode()
    assert adapter_and_stream("/v1/completions", JSON, body, "base") == ("sql", streams)
    if value is not None and not isinstance(value, list):  # the replica's reading (pydantic's lax bool)
        assert CompletionRequest(model="sql", prompt="x", stream=value).stream is streams


def test_a_replica_forwards_more_streams_at_once_than_httpx_pools_by_default() -> None:
    """httpx's default pool (100 connections, no pool timeout here) would hold stream 101 until
    one of the first 100 ended: a replica then served at most 100 requests at once, not Serve's 256."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from loraserve.api.server_thread import ServerThread

    from loraserve.entrypoints.ingress_protocol import replica_client

    num_streams = 150
    app = FastAPI()
    state = {"open": 0, "released": False}

    @app.get("/hold")
    async def hold() -> StreamingResponse:
        async def body() -> Any:
            state["open"] += 1
            yield b"data: open\n\n"
            while not state["released"]:
                await asyncio.sleep(0.01)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    async def open_all(url: str) -> list[bytes]:
        async with replica_client(url) as client:

            async def one() -> bytes:
                async with client.stream("GET", "/hold") as reply:
                    return b"".join([chunk async for chunk in reply.aiter_raw()])

            tasks = [asyncio.create_task(one()) for _ in range(num_streams)]
            deadline = asyncio.get_running_loop().time() + 30
            while state["open"] < num_streams and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            opened = state["open"]
            state["released"] = True
            assert opened == num_streams, f"{opened} of {num_streams} streams open at once"
            return await asyncio.gather(*tasks)

    with ServerThread(app) as server:
        bodies = asyncio.run(open_all(server.url))
    assert bodies == [b"data: open\n\ndata: [DONE]\n\n"] * num_streams


def test_requests_are_sent_again_unless_they_change_the_adapter_registry() -> None:
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions?x=1"), ("GET", "/v1/models"),
                         ("GET", "/v1/adapters"), ("GET", "/v1/adapters/sql"), ("POST", "/tokenize")]:  # fmt: skip
        assert may_resend(method, path), (method, path)
    for method, path in [("POST", "/v1/adapters"), ("DELETE", "/v1/adapters/sql"), ("post", "/v1/load_lora_adapter"),
                         ("POST", "/v1/unload_lora_adapter")]:  # fmt: skip
        assert not may_resend(method, path), (method, path)


def test_whole_events_are_passed_on_and_counted_wherever_the_raw_chunks_split_them() -> None:
    stream = b"".join(f'event: e{i}\ndata: {{"n": "event: {i}"}}\n\n'.encode() for i in range(5))
    for size in (1, 2, 3, 5, 7, 11, len(stream)):
        framer = EventFramer()
        passed = [framer.feed(stream[start : start + size]) for start in range(0, len(stream), size)]
        assert all(piece.endswith(b"\n\n") for piece in passed if piece), size
        assert b"".join(passed) == stream and framer.rest() == b"" and framer.num_events == 5, size
    cut = EventFramer()  # a replica dies mid-event: the partial event is never passed on
    first = stream.index(b"\n\n") + 2
    assert cut.feed(stream[: first + 12]) == stream[:first] and cut.num_events == 1
    untyped = EventFramer()
    assert untyped.feed(b'data: {"x": 1}\n\ndata: [DO') == b'data: {"x": 1}\n\n'
    assert untyped.rest() == b"data: [DO" and untyped.num_events == 0


def _client_stream(http: ModuleType, events: bytes) -> Any:
    """An HTTP client (of the SDK's own HTTP library) whose every request gets ``events`` as a stream."""

    def answer(request: Any) -> Any:
        return http.Response(200, headers={"content-type": "text/event-stream"}, content=events)

    return http.Client(transport=http.MockTransport(answer))


def test_a_cut_messages_stream_raises_in_anthropics_client() -> None:
    before = b'event: ping\ndata: {"type": "ping"}\n\n'
    events = before + stream_cut_event("/v1/messages", "the engine replica serving this stream died", 1)
    client = anthropic.Anthropic(api_key="k", base_url="http://ingress", http_client=_client_stream(httpx2, events))
    stream = client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}], stream=True)
    with pytest.raises(anthropic.APIStatusError, match="replica serving this stream died") as raised:
        list(stream)
    cut = {"type": "ServiceUnavailableError", "message": "the engine replica serving this stream died"}
    assert raised.value.body == {"type": "error", "error": cut}


def test_a_cut_responses_stream_ends_with_the_next_numbered_error_event() -> None:
    delta = {"type": "response.output_text.delta", "delta": "a", "item_id": "m", "output_index": 0,
             "content_index": 0, "logprobs": []}  # fmt: skip
    before = b"".join(
        f"event: {delta['type']}\ndata: {json.dumps({**delta, 'sequence_number': i})}\n\n".encode() for i in range(3)
    )
    framer = EventFramer()
    assert framer.feed(before) == before
    events = before + stream_cut_event("/v1/responses", "died", framer.num_events)
    client = openai.OpenAI(api_key="k", base_url="http://ingress/v1", http_client=_client_stream(httpx, events))
    received = list(client.responses.create(model="m", input="hi", stream=True))
    assert [e.type for e in received] == ["response.output_text.delta"] * 3 + ["error"]
    last = received[-1]
    assert (last.sequence_number, last.code, last.message, last.param) == (3, "503", "died", None)


def test_a_cut_completions_stream_raises_in_openais_client() -> None:
    events = b'data: {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": []}\n\n'
    events += stream_cut_event("/v1/completions", "died", 0)
    assert events.endswith(b"data: [DONE]\n\n")  # as the routes end a stream after an error
    client = openai.OpenAI(api_key="k", base_url="http://ingress/v1", http_client=_client_stream(httpx, events))
    with pytest.raises(openai.APIError, match="died"):
        list(client.completions.create(model="m", prompt="hi", stream=True))
