"""Incremental detokenization and stop-string detection."""

from __future__ import annotations

from collections.abc import Callable
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
        self._decode_fast = _fast_decoder(tokenizer)

    def start(self, seq: Sequence) -> None:
        seq.read_offset = seq.num_prompt_tokens
        seq.prefix_offset = max(0, seq.num_prompt_tokens - _NUM_PROMPT_CONTEXT_TOKENS)

    def update(self, seq: Sequence, end: int | None = None) -> str:
        """Decode tokens past ``read_offset`` (up to ``end``, exclusive; None: all); return the new
        text (may be empty)."""
        end = len(seq.token_ids) if end is None else end
        prefix_text, full_text = self._texts(seq, end)
        while full_text.endswith("\ufffd") and end - 1 > seq.read_offset:
            # Several tokens at once (a final_only output decoded when it ends): the text up to
            # the last token that completes a character, as decoding them one by one gives.
            end -= 1
            prefix_text, full_text = self._texts(seq, end)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = end
        seq.output_text += delta
        return delta

    def _texts(self, seq: Sequence, end: int) -> tuple[str, str]:
        """The text of the window before ``read_offset`` and of the window up to ``end``."""
        ids = seq.token_ids[seq.prefix_offset : end]
        num_prefix = seq.read_offset - seq.prefix_offset
        if seq.params.skip_special_tokens and not self.special_ids.isdisjoint(ids):
            special = self.special_ids
            num_prefix -= sum(t in special for t in ids[:num_prefix])
            ids = [t for t in ids if t not in special]
        if self._decode_fast is not None:
            return self._decode_fast(ids[:num_prefix]), self._decode_fast(ids)
        spaces = seq.params.spaces_between_special_tokens
        prefix_text = self.tokenizer.decode(ids[:num_prefix], spaces_between_special_tokens=spaces)
        return prefix_text, self.tokenizer.decode(ids, spaces_between_special_tokens=spaces)


def _fast_decoder(tokenizer: Any) -> Callable[[list[int]], str] | None:
    """The Rust tokenizer's own ``decode`` where it returns exactly what ``tokenizer.decode`` does
    (a Hugging Face fast tokenizer with its ``_decode`` not overridden and no clean-up of spaces;
    ``spaces_between_special_tokens`` is ignored by fast tokenizers). It skips the Python layers
    of ``tokenizer.decode`` (type checks and conversions), most of its cost per streamed token.
    None: use ``tokenizer.decode``."""
    try:
        from tokenizers import Tokenizer
        from transformers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if not (
        isinstance(tokenizer, TokenizersBackend)
        and isinstance(backend, Tokenizer)
        and type(tokenizer)._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return None
    decode = backend.decode
    return lambda ids: decode(ids, skip_special_tokens=False)


def find_stop_string(text: str, num_new_chars: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the last ``num_new_chars`` characters."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
