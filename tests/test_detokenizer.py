"""Incremental detokenization: token by token, the text equals decoding the whole output at once,
and the Rust tokenizer's direct decode gives exactly what ``tokenizer.decode`` gives."""

from __future__ import annotations

from typing import Any

import pytest

from loraserve.detokenizer import Detokenizer
from loraserve.sampling_params import SamplingParams
from loraserve.sequence import Sequence

TEXT = "Naïve café owners in Zürich said 日本語のテキスト 🎉🚀 — “quotes”, tabs\tand\nnew lines. ½ ≥ π"


def _stream(detokenizer: Detokenizer, prompt: list[int], output: list[int], params: SamplingParams) -> list[str]:
    """Feed ``output`` one token at a time; return the text each step added."""
    seq = Sequence("r", list(prompt), params)
    detokenizer.start(seq)
    deltas = []
    for token in output:
        seq.append_token(token)
        deltas.append(detokenizer.update(seq))
    assert seq.output_text == "".join(deltas)
    return deltas


def _slow(tokenizer: Any) -> Detokenizer:
    detokenizer = Detokenizer(tokenizer)
    detokenizer._decode_fast = None  # tokenizer.decode, the reference
    return detokenizer


def test_the_default_tokenizer_takes_the_direct_decode(tokenizer: Any) -> None:
    assert Detokenizer(tokenizer)._decode_fast is not None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_the_whole_decode(tokenizer: Any, skip_special_tokens: bool) -> None:
    prompt = tokenizer.encode("Translate, please:")
    special = sorted(tokenizer.all_special_ids)
    words = tokenizer.encode(TEXT)
    # Special tokens inside the output and at its ends; multi-byte characters split over tokens.
    output = [special[0], *words[:9], special[-1], *words[9:], special[0]]
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    fast = _stream(Detokenizer(tokenizer), prompt, output, params)
    assert fast == _stream(_slow(tokenizer), prompt, output, params)  # the same text at every step
    assert "".join(fast) == tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
    assert any(delta == "" for delta in fast)  # a character split over tokens waited for its last byte


def test_direct_decode_equals_tokenizer_decode(tokenizer: Any) -> None:
    fast = Detokenizer(tokenizer)._decode_fast
    assert fast is not None
    ids = tokenizer.encode(TEXT)
    for start in range(0, len(ids), 3):
        window = ids[start : start + 7]
        assert fast(window) == tokenizer.decode(window)


def test_decoding_at_the_end_keeps_what_one_by_one_keeps(tokenizer: Any) -> None:
    """A ``final_only`` output is decoded once, when it ends: an output cut inside a character
    keeps the text before that character, as token-by-token decoding does (not nothing)."""
    prompt = tokenizer.encode("Say:")
    words = tokenizer.encode("在 🎉🚀")
    cut_inside = 0
    for cut in range(1, len(words) + 1):
        output = words[:cut]
        by_token = "".join(_stream(Detokenizer(tokenizer), prompt, output, SamplingParams()))
        seq = Sequence("r", list(prompt), SamplingParams())
        detokenizer = Detokenizer(tokenizer)
        detokenizer.start(seq)
        for token in output:
            seq.append_token(token)
        detokenizer.update(seq, at_once=True)
        assert seq.output_text == by_token and by_token.startswith("在"), (cut, output)
        cut_inside += tokenizer.decode(output).endswith("\ufffd")
    assert cut_inside >= 2  # the emojis are split over tokens: some cuts fall inside them
