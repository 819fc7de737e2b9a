"""A request's inputs as token ids, checked against the model before it is queued (vLLM's
``Processor``): the prompt, the parameters that name token ids, bad words, the context length."""

from __future__ import annotations

from typing import Any

from loraserve.logits_adjustments import bad_word_bans, min_tokens_bans
from loraserve.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request cannot be served as asked; the message says why."""


class InputProcessor:
    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids  # banned until min_tokens, as the sampler bans them

    def encode(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids (a text tokenized, ids checked against the vocabulary)."""
        vocab = self.vocab_size
        if isinstance(prompt, str):
            token_ids = list(self.tokenizer.encode(prompt))
        else:
            token_ids = [int(t) for t in prompt]
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if not token_ids:
            raise RequestError("the prompt is empty")
        return token_ids

    def check(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """``RequestError`` if a parameter names a token id outside the vocabulary, or the prompt
        plus ``max_tokens`` does not fit the model's context."""
        vocab = self.vocab_size
        bad = [t for t, _ in params.logit_bias if t >= vocab] + [t for t in params.stop_token_ids if not 0 <= t < vocab]
        bad += [t for t in params.allowed_token_ids or () if t >= vocab]
        if bad:
            raise RequestError(
                f"logit_bias, stop_token_ids or allowed_token_ids name token ids {bad[:5]} outside [0, {vocab})"
            )
        if num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"model's context length of {self.max_model_len} tokens"
            )

    def check_samplable(self, params: SamplingParams, bad_words: tuple[tuple[int, ...], ...]) -> None:
        """``RequestError`` if ``allowed_token_ids`` leaves no token that may be sampled: all of
        them one-token bad words, or, while ``min_tokens`` holds, EOS or stop token ids (which the
        sampler bans until then). A row with every logit masked would otherwise sample a token
        outside the allowed set."""
        if params.allowed_token_ids is None:
            return
        allowed = set(params.allowed_token_ids) - set(bad_word_bans(bad_words, []))  # the one-token words
        if not allowed:
            raise RequestError("every token of allowed_token_ids is a bad word: no token could be generated")
        if params.min_tokens > 0 and not allowed - set(min_tokens_bans(params, self.eos_token_ids)):
            raise RequestError(
                f"allowed_token_ids leaves only EOS or stop token ids, which min_tokens ({params.min_tokens}) "
                "bans until then: no token could be generated"
            )

    def bad_words_token_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """vLLM's rule: each word as tokenized alone, and with a leading space when that gives
        another first token but as many tokens (the word inside a text)."""
        result: list[tuple[int, ...]] = []
        for word in words:
            alone = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if alone:
                result.append(alone)
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and (not alone or (spaced[0] != alone[0] and len(spaced) == len(alone))):
                result.append(spaced)
        return tuple(result)
