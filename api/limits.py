"""Limits an operator sets on what clients may send (``ServerSettings``), enforced at the edge.

* ``RequestBodyLimit``: an ASGI middleware that answers 413 (OpenAI error shape) to a request
  body larger than ``max_request_body_bytes``, whether it announces its length or streams it
  chunked, before any route parses it. Adapter uploads are exempt: they have their own, larger,
  limit (``max_upload_bytes``, checked while the upload streams in).
* ``body_limit`` and ``read_body_within``: the same limits where a body is read whole before it
  is passed on (the Ray Serve ingress, ``loraserve/entrypoints/ray_serve.py``).
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

from fastapi import Request
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
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(send)
            return
        # Read the body here (it is small by definition), so a chunked one is bounded too.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # a disconnect: the route sees it
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
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


async def read_body_within(request: Request, max_bytes: int) -> bytes | None:
    """``request``'s body, or None as soon as it announces or has sent more than ``max_bytes``
    (a chunked body is counted while it arrives, never buffered past the limit)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            return None
        chunks.append(chunk)
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
