"""Prompt tokenization for the API: long texts on a thread of their own, so the event loop (every
other client) runs on while a prompt of megabytes is tokenized; the ids are the tokenizer's."""

from __future__ import annotations

import asyncio
import copy
import threading
from typing import Any

from loraserve.api.prompt_encoder import INLINE_CHARS, PromptEncoder
from loraserve.api.routes_completions import MAX_CHOICES, max_choices_of


def test_long_prompts_are_tokenized_off_the_event_loop(tokenizer: Any) -> None:
    encoder = PromptEncoder(tokenizer, copy.deepcopy(tokenizer))
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


def test_many_short_prompts_long_together_are_tokenized_off_the_event_loop(tokenizer: Any) -> None:
    """A completion's prompts count together: many texts each under the limit go to the worker."""
    encoder = PromptEncoder(tokenizer, copy.deepcopy(tokenizer))
    worker_threads: list[str] = []
    worker_encode = encoder._worker_tokenizer.encode

    def recorded(*args: Any, **kwargs: Any) -> Any:
        worker_threads.append(threading.current_thread().name)
        return worker_encode(*args, **kwargs)

    encoder._worker_tokenizer.encode = recorded
    texts = [f"Prompt {i}: " + "lorem ipsum " * 100 for i in range(20)]  # ~1,200 characters each
    assert all(len(text) <= INLINE_CHARS for text in texts) and sum(map(len, texts)) > INLINE_CHARS
    try:
        ids = asyncio.run(encoder.encode_many(texts, add_special_tokens=True))
    finally:
        encoder.close()
    assert ids == [tokenizer.encode(text, add_special_tokens=True) for text in texts]
    assert len(worker_threads) == 20 and all(name.startswith("loraserve-tokenize") for name in worker_threads)


def test_one_prompt_may_take_max_n_choices_several_prompts_256() -> None:
    assert max_choices_of(1, 1000) == 1000 and max_choices_of(1, 8) == 8
    assert max_choices_of(2, 1000) == MAX_CHOICES == 256 and max_choices_of(4, 8) == 256
