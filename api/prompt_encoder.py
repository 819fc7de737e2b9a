"""Prompt tokenization off the event loop for long prompts.

A prompt's text is tokenized on the event loop before the length limits can be checked, and a
fast tokenizer takes seconds on a body of megabytes: every other client would wait that long.
Short texts are tokenized inline (a thread hop costs more than they do); longer ones on one
thread of their own, with a tokenizer instance of that thread's (a fast tokenizer must not be
used by two threads at once; it releases the GIL while it encodes, so the loop runs on).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

INLINE_CHARS = 16_384  # a request's texts this short in all are tokenized on the calling thread


class PromptEncoder:
    """``encode`` and ``encode_many`` are called on the event loop only; ``tokenizer`` is the
    loop's, ``worker_tokenizer`` (another instance of the same tokenizer) the worker thread's only."""

    def __init__(self, tokenizer: Any, worker_tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._worker_tokenizer = worker_tokenizer
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraserve-tokenize")

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The token ids of ``text``."""
        (ids,) = await self.encode_many([text], add_special_tokens)
        return ids

    async def encode_many(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """The token ids of each text; all on the worker thread when they are long together."""
        if sum(len(text) for text in texts) <= INLINE_CHARS:
            return _encode_all(self.tokenizer, texts, add_special_tokens)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, _encode_all, self._worker_tokenizer, texts, add_special_tokens)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def _encode_all(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    return [[int(token) for token in tokenizer.encode(text, add_special_tokens=add_special_tokens)] for text in texts]
