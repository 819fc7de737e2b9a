"""Limits an operator sets on what clients may send (``ServerSettings``), enforced at the edge.

* ``RequestBodyLimit``: an ASGI middleware that answers 413 (OpenAI error shape) to a request
  body larger than ``max_request_body_bytes``, whether it announces its length or streams it
  chunked, before any route parses it. Adapter uploads are exempt: they have their own, larger,
  limit (``max_upload_bytes``, checked while the upload streams in).
* ``read_body_within``: a body read whole unless it passes a limit (the middleware's, and the Ray
  Serve ingress's, ``loraserve/entrypoints/ray_serve.py``, whose limit for a path is ``body_limit``).
* ``InFlightLimiter``: completion requests in flight per API key (the server's API key and its
  admin key each have a bucket; every other request, whatever bearer token it sends when no key is
  checked, shares one); past the limit a request gets 429 at once and nothing is queued.
"""

from __future__ import annotations

import hmac
import json
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.security.utils import get_authorization_scheme_param

from .errors import APIError, error_body
from .settings import ServerSettings
from .uploads import FORM_OVERHEAD_BYTES, upload_too_large

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

UPLOAD_PATHS = ("/v1/adapters",)  # bodies bounded by max_upload_bytes instead


class RequestBodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD") or scope["path"] in UPLOAD_PATHS:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        body = await read_body_within(receive, declared.decode("latin-1") if declared else None, self.max_bytes)
        if body is None:
            await self._too_large(send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        body = json.dumps(error_body(_body_too_large_message(self.max_bytes), 413)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _body_too_large_message(max_bytes: int) -> str:
    return f"request body larger than this server's limit of {max_bytes} bytes (--max-request-body-mb)"


def body_limit(path: str, settings: ServerSettings) -> tuple[int, APIError]:
    """The most bytes a request body to ``path`` may have, and the 413 past it: an adapter upload
    its limit plus the multipart framing (the upload's own check is exact), any other request
    ``max_request_body_bytes``."""
    if path in UPLOAD_PATHS:
        return settings.max_upload_bytes + FORM_OVERHEAD_BYTES, upload_too_large(settings.max_upload_bytes)
    limit = settings.max_request_body_bytes
    return limit, APIError(413, _body_too_large_message(limit))


async def read_body_within(receive: Receive, declared: str | None, max_bytes: int) -> bytes | None:
    """The body that ``receive`` (ASGI) delivers, or None as soon as its declared length
    (Content-Length) or what has arrived is more than ``max_bytes``: a chunked body is counted
    while it arrives, never buffered past the limit. A disconnect ends it early (the route sees it)."""
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        return None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > max_bytes:
            return None
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


class InFlightLimiter:
    """Counts the completion requests each API key has in flight (any thread)."""

    def __init__(self, max_per_key: int, api_key: str | None = None, admin_key: str | None = None) -> None:
        self.max_per_key = max_per_key
        self._keys = {"admin": admin_key, "api": api_key}
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def bucket_of(self, authorization: str | None) -> str:
        """The bucket of a request that passed the API-key check: ``"admin"`` or ``"api"`` when its
        bearer token is one of the server's keys (read as the check reads it: the scheme in any
        case), else ``"anonymous"``; so tokens that no check looks at share one bucket, and a
        client cannot take more than the limit by sending new ones."""
        scheme, token = get_authorization_scheme_param(authorization)
        if scheme.lower() == "bearer" and token:
            for bucket, key in self._keys.items():
                if key is not None and hmac.compare_digest(token.encode(), key.encode()):
                    return bucket
        return "anonymous"

    def acquire(self, key: str) -> None:
        """Count one more request for ``key``, or raise a 429 ``APIError`` past the limit."""
        with self._lock:
            if self._counts[key] >= self.max_per_key:
                raise APIError(
                    429,
                    f"too many requests in flight for this API key (limit {self.max_per_key}, "
                    "--max-requests-per-key): retry when one finishes",
                )
            self._counts[key] += 1

    def release(self, key: str) -> None:
        with self._lock:
            self._counts[key] -= 1
            if self._counts[key] <= 0:
                del self._counts[key]

    def in_flight(self, key: str) -> int:
        with self._lock:
            return self._counts[key]

    def total(self) -> int:
        """Requests in flight over every key."""
        with self._lock:
            return sum(self._counts.values())
