"""Prompt tokenization for the API: long texts on a thread of their own, so the event loop (every
other client) runs on while a prompt of megabytes is tokenized; the ids are the tokenizer's."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from loraserve.api.prompt_encoder import INLINE_CHARS, PromptEncoder


def test_long_prompts_are_tokenized_off_the_event_loop(tokenizer: Any) -> None:
    encoder = PromptEncoder(tokenizer)
    worker_threads: list[str] = []
    started, done = threading.Event(), threading.Event()
    worker_encode = encoder._worker_tokenizer.encode

    def recorded(*args: Any, **kwargs: Any) -> Any:
        worker_threads.append(threading.current_thread().name)
        started.set()
        return worker_encode(*args, **kwargs)

    encoder._worker_tokenizer.encode = recorded
    short, long = "Hello, world! " * 10, "The quick brown fox jumps over the lazy dog. " * 40_000  # 1.8 M chars
    assert len(short) <= INLINE_CHARS < len(long)

    async def run() -> tuple[list[int], list[int], int]:
        ticks = 0

        async def ticker() -> None:  # counts the loop's turns while the long text is being encoded
            nonlocal ticks
            while not done.is_set():
                await asyncio.sleep(0.001)
                ticks += started.is_set() and not done.is_set()

        async def encode_long() -> list[int]:
            try:
                return await encoder.encode(long, add_special_tokens=False)
            finally:
                done.set()

        short_ids = await encoder.encode(short, add_special_tokens=True)
        assert worker_threads == []  # a short text: inline
        long_ids, _ = await asyncio.gather(encode_long(), ticker())
        return short_ids, long_ids, ticks

    try:
        short_ids, long_ids, ticks = asyncio.run(run())
    finally:
        encoder.close()
    assert short_ids == tokenizer.encode(short, add_special_tokens=True)
    assert long_ids == tokenizer.encode(long, add_special_tokens=False)
    assert len(worker_threads) == 1 and worker_threads[0].startswith("loraserve-tokenize")
    assert ticks > 0  # the loop turned while the worker encoded (none if it encoded inline)
