"""One request's output stream, and the errors that can end it.

The engine thread calls :meth:`RequestStream.deliver`; the consuming coroutine iterates. An
iteration ends after the finished output, or raises the error that ended the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from loraserve.adapters import AdapterNotFoundError, InvalidAdapterError, RegistryUnavailableError

from loraserve.outputs import REQUEST_TOO_LARGE, RequestOutput


class EngineDeadError(RuntimeError):
    """The engine thread is not running (stopped, or never started and cannot start)."""


class EngineDrainingError(RuntimeError):
    """The server is shutting down: it finishes the requests it has and takes no new ones."""


class EngineStepError(RuntimeError):
    """An engine step raised; every request in flight at that moment was aborted."""


class RequestAbortedError(RuntimeError):
    """The request was aborted by someone other than its own stream."""


class RequestFailedError(RuntimeError):
    """The engine could not run the request (``RequestOutput.error``, e.g. its adapter failed to load);
    ``code`` is ``RequestOutput.error_code`` (``"registry_unavailable"``: retry later)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code

    @property
    def status_code(self) -> int:
        """The HTTP status it answers: 503 when the adapter registry was unreachable; 400 when the
        request cannot fit the pool with its adapter (known only once the adapter loaded) or the
        stored adapter cannot be served (retrying cannot help; clients retry a 5xx); 404 when the
        adapter was deleted before its files were read; else 500."""
        return _STATUS_BY_CODE.get(self.code, 500)


_STATUS_BY_CODE: dict[str | None, int] = {
    REQUEST_TOO_LARGE: 400,
    InvalidAdapterError.code: 400,
    AdapterNotFoundError.code: 404,
    RegistryUnavailableError.code: 503,
}


class RequestStream:
    """Async iterator over one request's outputs (cumulative snapshots).

    When the consumer falls behind, intermediate snapshots are skipped: each output carries
    the whole text and token ids so far, so nothing is lost. Call :meth:`abort` (or let
    :meth:`AsyncEngine.generate` do it) when giving up on the request early.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, post_abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._post_abort = post_abort
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._done = False

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished; safe to call repeatedly and from ``finally``."""
        if not self._done:
            self._done = True
            self._post_abort(self.request_id)

    def mark_done(self) -> None:
        """The request will produce nothing more (it was refused); no abort is needed."""
        self._done = True

    def deliver(self, item: RequestOutput | BaseException) -> None:
        """Queue an output or the final error; called on the engine thread."""
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
