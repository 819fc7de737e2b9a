"""The messages the event loop posts to the engine thread (``async_engine.py``), and the
observer the engine thread tells about requests: a thread-safe FIFO of these commands is the
only way coroutines reach the engine."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from loraserve.llm_engine import LLMEngine
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams

from .request_stream import RequestStream


class EngineObserver(Protocol):
    """Receives request events on the engine thread (used for metrics); must not block."""

    def request_started(self, request_id: str, adapter_name: str | None, arrival_time: float) -> None: ...

    def request_output(self, output: RequestOutput, now: float) -> None: ...

    def request_ended(self, request_id: str) -> None: ...


@dataclass
class AddCommand:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    adapter_name: str | None
    stream: RequestStream
    accepted: concurrent.futures.Future[None]
    arrival_time: float
    cache_salt: str | None = None


@dataclass
class AbortCommand:
    request_id: str


@dataclass
class CallCommand:
    fn: Callable[[LLMEngine], Any]
    result: concurrent.futures.Future[Any]


class FinishAllCommand:
    """End every request in flight now, each with its output so far and finish reason ``abort``."""


class StopCommand:
    pass


EngineCommand = AddCommand | AbortCommand | CallCommand | FinishAllCommand | StopCommand
