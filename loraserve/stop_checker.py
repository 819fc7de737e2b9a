"""Whether a sequence ends with the token it just got: EOS, stop token ids, stop strings, lengths.

The scheduler calls it from ``update_from_output`` (the one place a sequence's state changes
after a step), so the sequence is finished and its pages freed in the same place.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from loraserve.detokenizer import Detokenizer, find_stop_string
from loraserve.sampling_params import SamplingParams
from loraserve.sequence import FinishReason, Sequence

logger = logging.getLogger(__name__)

Stop = tuple[FinishReason, str | int | None]  # (finish reason, the stop string or token that ended it)


class StopChecker:
    """Detokenizes each new token (or, for a ``final_only`` request without stop strings, the
    whole output once it ends) and says whether and why the sequence stops."""

    def __init__(self, detokenizer: Detokenizer, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.detokenizer = detokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def __call__(self, seq: Sequence, token: int) -> Stop | None:
        """As vLLM's v1 engine: EOS and stop token ids end a sequence from ``min_tokens`` output
        tokens on, and the text of the token that ended it is left out of ``output_text`` unless
        ``include_stop_str_in_output`` (its id stays in ``token_ids``); stop strings count once
        the output is longer than ``min_tokens`` tokens. A structured output ends with its
        grammar's EOS, ``ignore_eos`` or not."""
        params = seq.params
        if seq.grammar_rejected:  # vLLM ends such a request as an error
            logger.error("request %s: its grammar rejected token %d; ending it", seq.request_id, token)
            self.detokenizer.update(seq, at_once=decodes_at_end(params))
            return (FinishReason.ABORT, None)
        decode_at_end = decodes_at_end(params)
        num_tokens = len(seq.token_ids)
        num_output_tokens = num_tokens - seq.num_prompt_tokens
        if num_output_tokens >= params.min_tokens:
            by_token: Stop | None = None
            if not params.ignore_eos and token in self.eos_token_ids:
                by_token = (FinishReason.STOP, None)
            elif token in params.stop_token_ids:
                by_token = (FinishReason.STOP, token)
            elif seq.grammar is not None and seq.grammar.is_terminated():  # its EOS, with ignore_eos
                by_token = (FinishReason.STOP, None)
            if by_token is not None:
                end = None if params.include_stop_str_in_output else num_tokens - 1
                self.detokenizer.update(seq, end, at_once=decode_at_end)
                return by_token
        num_new_chars = 0 if decode_at_end else len(self.detokenizer.update(seq))
        stop: Stop | None = None
        if num_output_tokens < params.min_tokens:  # only the lengths end it before min_tokens
            if num_tokens >= self.max_model_len:
                stop = (FinishReason.LENGTH, None)
        elif (
            params.stop
            and num_output_tokens > params.min_tokens
            and (found := find_stop_string(seq.output_text, num_new_chars, params.stop))
        ):
            index, stop_string = found
            end = index + len(stop_string) if params.include_stop_str_in_output else index
            seq.output_text = seq.output_text[:end]
            stop = (FinishReason.STOP, stop_string)
        elif num_output_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            stop = (FinishReason.LENGTH, None)
        if decode_at_end and stop is not None:
            self.detokenizer.update(seq, at_once=True)
        return stop


def decodes_at_end(params: SamplingParams) -> bool:
    """Whether a sequence's text is decoded once, when it ends (``final_only``, no stop strings to
    look for), rather than token by token."""
    return params.output_kind == "final_only" and not params.stop


def never_stops_early(seq: Sequence, token: int) -> Stop | None:
    """A stop checker for tests without a tokenizer: only ``max_tokens`` ends a sequence."""
    return (FinishReason.LENGTH, None) if seq.num_output_tokens >= seq.params.max_tokens else None


def model_eos_token_ids(model_dir: str | os.PathLike[str], tokenizer: Any) -> frozenset[int]:
    """The model's end-of-sequence token ids: its tokenizer's and its generation config's."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        return frozenset(ids)
    eos = generation.eos_token_id
    ids.update([eos] if isinstance(eos, int) else list(eos or []))
    return frozenset(ids)
