"""The asyncio front of the engine, against a scripted fake engine (no model, fast)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

import pytest
from loraserve.api.async_engine import AsyncEngine, EngineDeadError, EngineStepError, RequestAbortedError

from loraserve.llm_engine import RequestError
from loraserve.outputs import CompletionOutput, RequestOutput
from loraserve.sampling_params import SamplingParams


class FakeEngine:
    """Each request emits one token per step until ``max_tokens``; records which thread touched it."""

    def __init__(self) -> None:
        self.requests: dict[str, SamplingParams] = {}
        self.tokens: dict[str, list[int]] = {}
        self.threads: set[str] = set()
        self.aborted: list[str] = []
        self.fail_next_step = False
        self.gate = threading.Event()
        self.gate.set()

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, adapter_name: Any = None) -> None:
        self.threads.add(threading.current_thread().name)
        if prompt == "bad":
            raise RequestError("bad prompt")
        self.requests[request_id] = params
        self.tokens[request_id] = []

    def abort_request(self, request_id: str) -> None:
        self.threads.add(threading.current_thread().name)
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.current_thread().name)
        self.gate.wait(5)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outputs = []
        for request_id, params in list(self.requests.items()):
            tokens = self.tokens[request_id]
            tokens.append(len(tokens))
            done = len(tokens) >= params.max_tokens
            completion = CompletionOutput(0, "x" * len(tokens), list(tokens), "length" if done else None)
            outputs.append(RequestOutput(request_id, None, [1], [completion], done))
            if done:
                del self.requests[request_id]
        return outputs


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_generate_streams_until_finished_on_the_engine_thread() -> None:
    fake = FakeEngine()
    engine = AsyncEngine(fake)  # type: ignore[arg-type]

    async def main() -> list[RequestOutput]:
        return [out async for out in engine.generate("a", "p", SamplingParams(max_tokens=3))]

    outputs = run(main())
    assert outputs[-1].finished and outputs[-1].token_ids == [0, 1, 2]
    assert fake.threads == {"loraserve-engine"}
    engine.shutdown()


def test_add_errors_reach_the_caller() -> None:
    engine = AsyncEngine(FakeEngine())  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="bad prompt"):
        run(engine.add_request("a", "bad", SamplingParams()))
    engine.shutdown()


def test_leaving_early_aborts() -> None:
    fake = FakeEngine()
    engine = AsyncEngine(fake)  # type: ignore[arg-type]

    async def main() -> None:
        async with contextlib.aclosing(engine.generate("a", "p", SamplingParams(max_tokens=10_000))) as outputs:
            async for _ in outputs:
                break
        await engine.call(lambda _: None)  # commands are FIFO: the abort ran before this

    run(main())
    assert fake.aborted == ["a"] and not fake.requests
    engine.shutdown()


def test_cancelled_task_aborts() -> None:
    fake = FakeEngine()
    engine = AsyncEngine(fake)  # type: ignore[arg-type]

    running = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("a", "p", SamplingParams(max_tokens=10_000)):
            running.set()  # the cancellation lands inside the generator, whose finally aborts

    async def main() -> None:
        task = asyncio.create_task(consume())
        await running.wait()  # accepted and streaming (cancelled earlier, the add itself is called off)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.call(lambda _: None)

    run(main())
    assert fake.aborted == ["a"]
    engine.shutdown()


def test_step_failure_fails_streams_and_engine_recovers() -> None:
    fake = FakeEngine()
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    fake.gate.clear()

    async def main() -> None:
        stream = await engine.add_request("a", "p", SamplingParams(max_tokens=5))
        fake.fail_next_step = True
        fake.gate.set()
        with pytest.raises(EngineStepError, match="boom"):
            async for _ in stream:
                pass
        outputs = [out async for out in engine.generate("b", "p", SamplingParams(max_tokens=2))]
        assert outputs[-1].finished

    run(main())
    assert engine.num_step_errors == 1
    engine.shutdown()


def test_abort_by_someone_else_and_shutdown() -> None:
    fake = FakeEngine()
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    fake.gate.clear()

    async def main() -> None:
        stream = await engine.add_request("a", "p", SamplingParams(max_tokens=5))
        engine.post_abort("a")
        fake.gate.set()
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        assert await engine.call(lambda e: e.has_unfinished_requests()) is False

    run(main())
    engine.shutdown()
    assert not engine.is_running
    with pytest.raises(EngineDeadError):
        run(engine.add_request("c", "p", SamplingParams()))


def test_run_on_this_thread_owns_the_calling_thread_until_shutdown() -> None:
    """``loraserve serve`` runs the loop on its main thread; here a thread named "owner" plays it."""
    fake = FakeEngine()
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    ready = threading.Event()
    owner = threading.Thread(target=engine.run_on_this_thread, kwargs={"ready": ready.set}, name="owner")
    owner.start()
    assert ready.wait(5)
    with pytest.raises(RuntimeError, match="already running"):
        engine.run_on_this_thread()

    async def main() -> list[RequestOutput]:
        return [out async for out in engine.generate("a", "p", SamplingParams(max_tokens=2))]

    outputs = run(main())
    assert outputs[-1].finished and fake.threads == {"owner"}  # start() did not make a thread of its own
    engine.shutdown()  # tells the loop to stop without joining the owner from here
    owner.join(5)
    assert not owner.is_alive()
    with pytest.raises(EngineDeadError):
        engine.start()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop's thread dies
def test_a_request_posted_while_the_loop_dies_is_refused_not_lost(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A dying loop fails what is queued, then its thread ends a moment later. A request posted in
    between was once queued where nothing would read it, and its client waited forever."""
    fake = FakeEngine()
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    in_window, release = threading.Event(), threading.Event()

    def dying_step() -> list[RequestOutput]:
        raise SystemExit("injected: the loop dies")

    class HoldTheLastLogLine(logging.Handler):  # keeps the dying thread alive, past the queue's draining
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() == "engine loop stopped":
                in_window.set()
                release.wait(10)

    monkeypatch.setattr(fake, "step", dying_step)
    caplog.set_level(logging.INFO, logger="loraserve.api.async_engine")
    holder = HoldTheLastLogLine()
    logging.getLogger("loraserve.api.async_engine").addHandler(holder)

    async def main() -> None:
        stream = await engine.add_request("a", "p", SamplingParams(max_tokens=5))
        with pytest.raises(EngineDeadError, match="the engine loop stopped"):
            async for _ in stream:
                pass
        assert await asyncio.to_thread(in_window.wait, 5)
        with pytest.raises(EngineDeadError, match="has died"):
            await asyncio.wait_for(engine.add_request("b", "p", SamplingParams()), 5)
        with pytest.raises(EngineDeadError, match="has died"):
            await asyncio.wait_for(engine.call(lambda _: None), 5)

    try:
        run(main())
    finally:
        release.set()
        engine.shutdown()  # joins the dying thread, so its exception is reported in this test
        logging.getLogger("loraserve.api.async_engine").removeHandler(holder)
    assert not engine.is_running
