"""Streaming plumbing: SSE framing, merging several request streams, text deltas that never
have to be taken back, and cancellation of non-streaming handlers when the client leaves."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loraserve.outputs import CompletionOutput, RequestOutput

from .async_engine import EngineDeadError, EngineStepError, RequestAbortedError, RequestFailedError, RequestStream
from .errors import APIError

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnectedError(Exception):
    """The client closed the connection before the response was ready."""


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def request_error(error: BaseException) -> APIError:
    """The error a request gets when it fails after it was accepted, streamed or not: 503 for an
    engine that stopped (or an adapter registry that was unreachable), a 4xx for an adapter that
    could not be loaded for its content (``RequestFailedError.status_code``), else 500, with the reason."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, RequestFailedError):
        retry = {"Retry-After": "1"} if error.status_code == 503 else None
        return APIError(error.status_code, str(error), headers=retry)
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error))
    if isinstance(error, EngineStepError | RequestAbortedError):
        return APIError(500, str(error))
    return APIError(500, f"internal error: {type(error).__name__}")


def sse_error(error: BaseException) -> str:
    """The SSE event for an error after the stream started (the official client raises on it)."""
    return sse_event(request_error(error).body())


def closing(streams: list[RequestStream], release: Callable[[], None]) -> Callable[[], None]:
    """A streamed response's ``on_close``: abort its engine requests (nothing for finished ones; a
    generator closed before its first event never reaches its own ``finally``), then ``release``."""

    def close() -> None:
        try:
            for stream in streams:
                stream.abort()
        finally:
            release()

    return close


class SSEResponse(StreamingResponse):
    """``text/event-stream`` that always closes its generator, so an abandoned stream aborts its
    engine requests at once instead of whenever the generator is garbage collected."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None] | None = None) -> None:
        """``on_close``: called once when the response ends, however it ends."""
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()


async def merge_streams(streams: list[RequestStream]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Yield ``(stream index, output)`` from several streams as outputs arrive.

    Closing the iterator early aborts every stream that has not finished.
    """
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            streams[0].abort()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except Exception as error:
            await queue.put((index, error))
        else:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


async def collect_final(streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished output of every stream (in order)."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for index, output in merge_streams(streams):
            if output.finished:
                finals[index] = output
    except (RequestFailedError, EngineDeadError, EngineStepError, RequestAbortedError) as error:
        raise request_error(error) from None
    if any(final is None for final in finals):
        raise request_error(RequestAbortedError("a request ended without a final output"))
    return [final for final in finals if final is not None]


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (which aborts its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    logger.info("client disconnected from %s; its requests were aborted", request.url.path)
    raise ClientDisconnectedError


@dataclass
class DeltaTracker:
    """What of one choice was already sent; holds back text that a stop string might still cut.

    The engine removes a stop string from ``text`` only once it is complete, so the last
    ``len(longest stop) - 1`` characters may still disappear; they are sent when the choice
    finishes (or when more text pushes them out of the window).
    """

    holdback: int = 0
    num_chars_sent: int = 0
    num_tokens_sent: int = 0
    finished: bool = False

    @classmethod
    def for_stops(cls, stops: tuple[str, ...]) -> DeltaTracker:
        return cls(holdback=max((len(stop) for stop in stops), default=1) - 1)

    def next_text(self, completion: CompletionOutput) -> str:
        done = completion.finish_reason is not None
        end = len(completion.text) if done else max(self.num_chars_sent, len(completion.text) - self.holdback)
        delta = completion.text[self.num_chars_sent : end]
        self.num_chars_sent = end
        return delta

    def next_token_range(self, completion: CompletionOutput) -> tuple[int, int]:
        start, self.num_tokens_sent = self.num_tokens_sent, len(completion.token_ids)
        return start, self.num_tokens_sent
