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

    def update(self, seq: Sequence, end: int | None = None, at_once: bool = False) -> str:
        """Decode tokens past ``read_offset`` (up to ``end``, exclusive; None: all); return the new
        text (may be empty). ``at_once``: the tokens were not decoded one by one as they came (a
        ``final_only`` output decoded when it ends): the text stops after the last token that
        completes a character, as one-by-one decoding would have left it."""
        end = len(seq.token_ids) if end is None else end
        while at_once and end - 1 > seq.read_offset and self._ends_inside_a_character(seq, end):
            end -= 1
        ids = seq.token_ids[seq.prefix_offset : end]
        prefix_text = self._decode(seq, ids[: seq.read_offset - seq.prefix_offset])
        full_text = self._decode(seq, ids)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = end
        seq.output_text += delta
        return delta

    def _ends_inside_a_character(self, seq: Sequence, end: int) -> bool:
        # A character has at most 4 bytes and a token at least one: the last 4 tokens tell.
        return self._decode(seq, seq.token_ids[max(seq.read_offset, end - 4) : end]).endswith("\ufffd")

    def _decode(self, seq: Sequence, ids: list[int]) -> str:
        """The text of ``ids`` (special tokens left out if the request says so)."""
        if seq.params.skip_special_tokens and not self.special_ids.isdisjoint(ids):
            ids = [t for t in ids if t not in self.special_ids]
        if self._decode_fast is not None:
            return self._decode_fast(ids)
        return str(self.tokenizer.decode(ids, spaces_between_special_tokens=seq.params.spaces_between_special_tokens))


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
