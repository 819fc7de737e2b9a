"""An asyncio front for the synchronous :class:`~loraserve.llm_engine.LLMEngine`.

Threading contract: one background thread (the *engine thread*) owns the engine. It is the
only code that ever touches the engine object. Coroutines talk to it through a thread-safe
FIFO of commands (add, abort, call) that the thread drains before every step, and the thread
hands each step's outputs back to the waiting coroutines with ``loop.call_soon_threadsafe``
into one ``asyncio.Queue`` per request. Because commands are FIFO, an abort posted after an
add always finds the request.

A request's stream ends with its finished output, or with an exception: the engine's own
error for a bad request (raised by :meth:`AsyncEngine.add_request` before any output),
:class:`RequestAbortedError` when someone else aborted it, :class:`RequestFailedError` when the
engine could not run it (its adapter failed to load), :class:`EngineStepError` when a
step failed, :class:`EngineDeadError` when the engine thread stopped. Dropping a stream
before it finished (client disconnect, task cancellation) aborts the request, which frees its
pages on the engine thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from loraserve.llm_engine import LLMEngine
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams

from .engine_commands import (
    AbortCommand,
    AddCommand,
    CallCommand,
    EngineCommand,
    EngineObserver,
    FinishAllCommand,
    StopCommand,
)
from .request_stream import (
    EngineDeadError,
    EngineDrainingError,
    EngineStepError,
    RequestAbortedError,
    RequestFailedError,
    RequestStream,
)

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineObserver",
    "EngineStepError",
    "RequestAbortedError",
    "RequestFailedError",
    "RequestStream",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_THREAD_NAME = "loraserve-engine"
# An idle loop wakes this often. A signal sent to the process may be taken by any of its threads
# (uvicorn's, OpenMP's); Python then runs its handler only once the main thread runs bytecode
# again, so a loop waiting on the main thread with no timeout would never see SIGTERM.
_IDLE_WAKE_S = 0.5


class AsyncEngine:
    """Runs ``engine.step()`` on a background thread while there is work; see the module docstring."""

    def __init__(self, engine: LLMEngine, observer: EngineObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False
        # Set by the loop, under the lock, before it fails what is queued: a command posted after
        # that would wait forever, though the dying thread is still alive for a moment.
        self._loop_ended = False
        self.draining = False  # shutting down: no new requests, the ones in flight run on
        self.num_step_errors = 0

    # ---- lifecycle --------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._loop_ended

    def start(self) -> None:
        """Start the engine thread (idempotent). Raises EngineDeadError after :meth:`shutdown`."""
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._stopped:
            raise EngineDeadError("the engine loop was shut down")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=_THREAD_NAME, daemon=True)
            self._thread.start()
        elif self._loop_ended or not self._thread.is_alive():
            raise EngineDeadError("the engine loop thread has died; see the server log")

    def run_on_this_thread(self, ready: Callable[[], None] | None = None) -> None:
        """Run the engine loop on the calling thread until :meth:`shutdown` (instead of the thread
        :meth:`start` makes); ``ready()`` runs once the loop owns this thread (start the server there).

        Why: on the 2-core CPU this was measured on, the engine ran 30-50 % slower on a new thread
        than on the thread that loaded the model (the two threads' OpenMP teams interfere).
        """
        with self._lock:
            if self._stopped:
                raise EngineDeadError("the engine loop was shut down")
            if self._thread is not None:
                raise RuntimeError("the engine loop is already running")
            self._thread = threading.current_thread()
        if ready is not None:
            ready()
        self._run()

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not finished (any thread may poll it)."""
        return len(self._streams)

    def begin_drain(self) -> None:
        """Take no new requests (they fail with :class:`EngineDrainingError`); the others run on."""
        self.draining = True

    def finish_all(self) -> None:
        """End every request in flight at once: each gets its output so far, finished with reason
        ``abort`` (the end of a drain that ran out of time)."""
        if self.is_running:
            self._commands.put(FinishAllCommand())

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine loop; requests still in flight are aborted and their streams fail.

        Waits for a loop thread that :meth:`start` made; a loop run by :meth:`run_on_this_thread`
        is only told to stop (its caller returns from it).
        """
        with self._lock:
            self._stopped = True
            thread = self._thread
        if thread is not None and thread.is_alive():
            self._commands.put(StopCommand())
            if thread.name != _THREAD_NAME or thread is threading.current_thread():
                return
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("engine thread did not stop within %.0f s", timeout)

    # ---- the API for coroutines -------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        adapter_name: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Submit a request; return its stream once the engine accepted it.

        ``cache_salt`` keeps its prefix cache apart from other salts'. Raises whatever
        ``LLMEngine.add_request`` raises for a bad request (``RequestError`` and subclasses), or
        :class:`EngineDeadError`.
        """
        stream = RequestStream(request_id, asyncio.get_running_loop(), self.post_abort)
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._post(AddCommand(request_id, prompt, params, adapter_name, stream, accepted, time.monotonic(), cache_salt))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            stream.abort()
            raise
        except BaseException:
            stream.mark_done()
            raise
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        adapter_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last one has ``finished`` set.

        Cancellation while waiting for an output aborts the request at once. To stop early with
        ``break``, iterate inside ``contextlib.aclosing(engine.generate(...))`` (otherwise the abort
        waits until the generator is garbage collected), or use :meth:`add_request` and
        :meth:`RequestStream.abort`.
        """
        stream = await self.add_request(request_id, prompt, params, adapter_name)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result (or raise)."""
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._post(CallCommand(fn, result))
        return await asyncio.wrap_future(result)

    def post_abort(self, request_id: str) -> None:
        """Abort a request (no-op when unknown or finished). Never blocks, never raises."""
        if self.is_running:
            self._commands.put(AbortCommand(request_id))

    def _post(self, command: EngineCommand) -> None:
        with self._lock:
            self._start_locked()
            self._commands.put(command)

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        logger.info("engine loop started")
        try:
            while True:
                if not self._drain_commands(block=not self.engine.has_unfinished_requests()):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        except KeyboardInterrupt:  # Ctrl-C on a loop run by run_on_this_thread
            raise
        except BaseException:
            logger.exception("engine loop crashed")
            raise
        finally:
            with self._lock:
                self._loop_ended = True
            self._fail_all(EngineDeadError("the engine loop stopped"))
            self._fail_pending_commands()
            logger.info("engine loop stopped")

    def _drain_commands(self, block: bool) -> bool:
        """Execute queued commands (waiting for one when ``block``); False once told to stop."""
        try:
            command = self._commands.get(timeout=_IDLE_WAKE_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, StopCommand):
                return False
            self._execute(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _execute(self, command: EngineCommand) -> None:
        if isinstance(command, AddCommand):
            if not command.accepted.set_running_or_notify_cancel():
                return  # the caller gave up before we got here; its abort follows
            if self.draining:
                command.accepted.set_exception(EngineDrainingError("the server is shutting down"))
                return
            try:
                args = (command.request_id, command.prompt, command.params, command.adapter_name)
                if command.cache_salt is None:  # so engines without salts (test fakes) work too
                    self.engine.add_request(*args)
                else:
                    self.engine.add_request(*args, cache_salt=command.cache_salt)
            except Exception as error:
                command.accepted.set_exception(error)
                return
            self._streams[command.request_id] = command.stream
            self._notify("request_started", command.request_id, command.adapter_name, command.arrival_time)
            command.accepted.set_result(None)
        elif isinstance(command, AbortCommand):
            stream = self._streams.pop(command.request_id, None)
            self.engine.abort_request(command.request_id)
            if stream is not None:
                self._notify("request_ended", command.request_id)
                stream.deliver(RequestAbortedError(f"request {command.request_id} was aborted"))
        elif isinstance(command, FinishAllCommand):
            streams, self._streams = self._streams, {}
            for request_id, stream in streams.items():
                output = self.engine.finish_request(request_id)  # its samples now carry finish reason abort
                self._notify("request_ended", request_id)
                stream.deliver(RequestAbortedError(f"request {request_id} was aborted") if output is None else output)
        elif isinstance(command, CallCommand):
            if not command.result.set_running_or_notify_cancel():
                return
            try:
                command.result.set_result(command.fn(self.engine))
            except Exception as error:
                command.result.set_exception(error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:
            self.num_step_errors += 1
            logger.exception("engine step failed; aborting %d request(s) in flight", len(self._streams))
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)
            self._fail_all(EngineStepError(f"the engine failed while running this request: {error}"))
            return
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            self._notify("request_output", output, now)
            if output.finished:
                self._streams.pop(output.request_id, None)
                self._notify("request_ended", output.request_id)
            if stream is not None:
                stream.deliver(RequestFailedError(output.error, output.error_code) if output.error else output)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self._notify("request_ended", request_id)
            stream.deliver(error)

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            future = command.accepted if isinstance(command, AddCommand) else getattr(command, "result", None)
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the engine loop stopped"))

    def _notify(self, event: str, *args: Any) -> None:
        if self.observer is None:
            return
        try:
            getattr(self.observer, event)(*args)
        except Exception:
            logger.exception("engine observer failed on %s", event)
