"""What the Ray Serve ingress reads from a request and writes into a reply on its own.

The ingress forwards bodies and headers as they are; it reads only the adapter a request names
(to route it by Serve's multiplexed model id) and whether it streams, and it writes only the
errors of its own: a 503 when no replica could answer, and the last event of a stream whose
replica died, in the shape of the route the stream came from (clients of each API parse their
own). Also the HTTP client a replica forwards with to its own API. No Ray here, so this is
testable without a Ray instance.
"""

import json
from collections.abc import Mapping
from typing import Any

import httpx
from pydantic import TypeAdapter, ValidationError

from loraserve.api.routes_invocations import ADAPTER_HEADER

_BOOL = TypeAdapter(bool)


def adapter_and_stream(path: str, headers: Mapping[str, str], body: bytes, base_model: str) -> tuple[str, bool]:
    """The adapter a JSON body names in ``model`` ("" for the base model or none) and its ``stream``;
    on ``/invocations`` SageMaker's adapter header, where sent, names it instead (as the replica reads it)."""
    if "json" not in headers.get("content-type", "") or not body:
        return "", False
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError):
        return "", False  # the replica answers the 400
    if not isinstance(fields, dict):
        return "", False
    model = fields.get("model")
    if path == "/invocations" and headers.get(ADAPTER_HEADER.lower()):
        model = headers[ADAPTER_HEADER.lower()]
    adapter = model if isinstance(model, str) and model != base_model else ""
    return adapter, _is_true(fields.get("stream"))


def _is_true(value: Any) -> bool:
    """``value`` as the replica's request model reads a bool (pydantic's lax mode: ``1``,
    ``"true"``, ``"yes"`` are true), so a stream is forwarded as one whenever the replica streams it."""
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return False


def replica_client(base_url: str) -> httpx.AsyncClient:
    """A replica's client to its own API on ``base_url``: no limit on connections (httpx's default
    of 100 would queue requests past it, streams included, forever: Serve's ``max_ongoing_requests``
    is the replica's limit) and no timeout (a request runs as long as the engine takes)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits)


# Routes that change the adapter registry: sent once, as a replica that died (or became unreachable)
# may have made the change before it did, and a second send would answer as if it had not (a 409, a 404).
_CHANGES_REGISTRY = ("/v1/adapters", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def may_resend(method: str, path: str) -> bool:
    """Whether the ingress may send a request again, to another replica, when the one it went to
    died before answering: any request but a change to the adapter registry (its client gets the
    503 and can look at ``GET /v1/adapters``)."""
    changes = method.upper() not in ("GET", "HEAD") and path.startswith(_CHANGES_REGISTRY)
    return not changes


def unavailable_body(message: str) -> dict[str, Any]:
    """vLLM's error body for a 503 (as the replicas' own errors are shaped)."""
    return {"error": {"message": message, "type": "ServiceUnavailableError", "param": None, "code": 503}}


class EventFramer:
    """Passes a server-sent event stream read in raw chunks (which may end anywhere) on whole
    events only, holding back a partial one, so that a stream cut mid-event ends cleanly; counts
    the typed events passed on (``event:`` lines; data lines hold JSON, which has no raw newlines)."""

    END = b"\n\n"

    def __init__(self) -> None:
        self.num_events = 0
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        """The whole events completed by ``chunk`` (b"" while one is still partial)."""
        data = self._held + chunk
        cut = data.rfind(self.END) + len(self.END)  # 1 when there is no end yet: nothing whole
        if cut < len(self.END):
            self._held = data
            return b""
        whole, self._held = data[:cut], data[cut:]
        self.num_events += sum(1 for line in whole.split(b"\n") if line.startswith(b"event:"))
        return whole

    def rest(self) -> bytes:
        """What the stream ended with after its last whole event (normally nothing)."""
        rest, self._held = self._held, b""
        return rest


def stream_cut_event(path: str, message: str, events_sent: int) -> bytes:
    """The event that ends a stream cut by its replica's death, as the route's own errors after the
    stream started: Anthropic's ``error`` event on ``/v1/messages``, the Responses API's numbered
    ``error`` event on ``/v1/responses``, else vLLM's error body as a ``data:`` line, then ``[DONE]``."""
    if path == "/v1/messages":
        data: dict[str, Any] = {"type": "error", "error": {"type": "ServiceUnavailableError", "message": message}}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    if path == "/v1/responses":
        data = {"code": "503", "message": message, "param": None, "sequence_number": events_sent, "type": "error"}
        return f"event: error\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
    return f"data: {json.dumps(unavailable_body(message))}\n\ndata: [DONE]\n\n".encode()  # as the routes end one
