"""Prompt tokenization off the event loop for long prompts.

A prompt's text is tokenized on the event loop before the length limits can be checked, and a
fast tokenizer takes seconds on a body of megabytes: every other client would wait that long.
Short texts are tokenized inline (a thread hop costs more than they do); longer ones on one
thread of their own, with a tokenizer instance of that thread's (a fast tokenizer must not be
used by two threads at once; it releases the GIL while it encodes, so the loop runs on).
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any

INLINE_CHARS = 16_384  # texts this short are tokenized on the calling thread


class PromptEncoder:
    def __init__(self, tokenizer: Any) -> None:
        """``tokenizer``: the event loop's own (the API's); the worker thread gets a copy."""
        self.tokenizer = tokenizer
        self._worker_tokenizer = copy.deepcopy(tokenizer)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraserve-tokenize")

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The token ids of ``text`` (call on the event loop)."""
        if len(text) <= INLINE_CHARS:
            return _encode(self.tokenizer, text, add_special_tokens)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, _encode, self._worker_tokenizer, text, add_special_tokens)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return [int(token) for token in tokenizer.encode(text, add_special_tokens=add_special_tokens)]
