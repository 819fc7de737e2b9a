"""Incremental detokenization and stop-string detection."""

from __future__ import annotations

from typing import Any

from loraserve.sequence import Sequence

_NUM_PROMPT_CONTEXT_TOKENS = 5


class Detokenizer:
    """Appends each new token's text to ``seq.output_text``.

    Text is decoded over a small window of tokens before the new ones so that
    leading spaces and multi-byte characters split across tokens come out right; a
    token that ends in an incomplete character waits for the next one.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special_ids = frozenset(tokenizer.all_special_ids)

    def start(self, seq: Sequence) -> None:
        seq.read_offset = seq.num_prompt_tokens
        seq.prefix_offset = max(0, seq.num_prompt_tokens - _NUM_PROMPT_CONTEXT_TOKENS)

    def update(self, seq: Sequence) -> str:
        """Decode tokens past ``read_offset``; return the new text (may be empty)."""
        special = self.special_ids if seq.params.skip_special_tokens else frozenset()
        ids = [t for t in seq.token_ids[seq.prefix_offset :] if t not in special]
        num_prefix = len([t for t in seq.token_ids[seq.prefix_offset : seq.read_offset] if t not in special])
        spaces = seq.params.spaces_between_special_tokens
        prefix_text = self.tokenizer.decode(ids[:num_prefix], spaces_between_special_tokens=spaces)
        full_text = self.tokenizer.decode(ids, spaces_between_special_tokens=spaces)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = seq.num_tokens
        seq.output_text += delta
        return delta


def find_stop_string(text: str, num_new_chars: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the last ``num_new_chars`` characters."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
