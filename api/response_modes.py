"""How an inference route answers, whole or streamed, once its engine requests are ready to go:
the client's in-flight slot (429 past the limit), the submission, and what happens when the
client leaves (a whole answer: 499 and the requests aborted; a stream: aborted when it closes)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request, Response

from loraserve.outputs import RequestOutput

from .async_engine import RequestStream
from .serving import ServerState
from .streaming import ClientDisconnectedError, SSEResponse, cancel_on_disconnect, closing, collect_final


async def answer(
    state: ServerState,
    request: Request,
    submit: Callable[[], Awaitable[list[RequestStream]]],
    stream: bool,
    events: Callable[[list[RequestStream]], AsyncIterator[str]],
    whole: Callable[[list[RequestOutput]], Any],
) -> Any:
    """``events(streams)`` as server-sent events when ``stream``, else ``whole(final outputs)``;
    ``submit`` adds the engine requests (``serving.submit``) once the slot is taken."""
    # The key the auth check accepted (whichever header brought it), else the bearer token's bucket.
    key = getattr(request.state, "key_bucket", None) or state.in_flight.bucket_of(request.headers.get("authorization"))
    state.in_flight.acquire(key)  # 429 past the limit

    def release() -> None:
        state.in_flight.release(key)

    if stream:
        try:
            streams = await submit()
        except BaseException:
            release()
            raise
        return SSEResponse(events(streams), on_close=closing(streams, release))

    async def complete() -> Any:
        return whole(await collect_final(await submit()))

    try:
        return await cancel_on_disconnect(request, complete())
    except ClientDisconnectedError:
        return Response(status_code=499)
    finally:
        release()
