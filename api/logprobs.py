"""Engine logprobs (one ``{token id: logprob}`` per generated token) in the OpenAI shapes.

A token's text is its own decode, except where that ends inside a character (byte-level tokens
of a multi-byte character): then, as vLLM's, it is the text it completes given up to 4 tokens
before it, or ``""`` while the character is still incomplete, so that the texts of a choice's
tokens add up to its text and ``text_offset`` points into it. The tokens before it are the
earlier generated tokens for generated ones (not the prompt's), and the earlier prompt tokens
after the first for prompt ones (vLLM's context: the positions that have logprobs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from loraserve.outputs import CompletionOutput, RequestOutput

from .openai_responses import ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs
from .serving import ServerState

_FLOOR = -9999.0  # JSON has no -inf
_CONTEXT = 4  # tokens: the longest UTF-8 character is 4 bytes


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


def token_text_after(state: ServerState, token_id: int, before: Sequence[int]) -> str:
    """The text of ``token_id`` following the tokens ``before`` (only the last 4 are read)."""
    text = state.token_text(token_id)
    if not text.endswith("\ufffd"):
        return text
    context = list(before[-_CONTEXT:])
    for size in range(1, len(context) + 1):
        window = context[-size:]
        whole = str(state.tokenizer.decode([*window, token_id]))
        if whole.endswith("\ufffd"):
            continue  # still inside the character: more context, or nothing
        clean = len(window)  # the earlier tokens of this character had no text of their own
        while clean > 0 and state.token_text(window[clean - 1]).endswith("\ufffd"):
            clean -= 1
        shown = str(state.tokenizer.decode(window[:clean])) if clean else ""
        common = next((i for i, (a, b) in enumerate(zip(shown, whole, strict=False)) if a != b), len(shown))
        return whole[min(common, len(whole)) :]
    return ""


def _ordered(entry: dict[int, float], token_id: int) -> list[tuple[int, float]]:
    """vLLM's order of a token's alternatives: the token itself first, then the others likeliest first."""
    own = [(token_id, entry[token_id])] if token_id in entry else []
    return own + sorted(((tid, lp) for tid, lp in entry.items() if tid != token_id), key=lambda item: -item[1])


def _generated_before(ids: Sequence[int], position: int) -> Sequence[int]:
    """The generated tokens before ``position`` that a generated token's text may complete."""
    return ids[max(0, position - _CONTEXT) : position]


def completion_logprobs(
    state: ServerState, completion: CompletionOutput, start: int, end: int, text_offset: int
) -> CompletionLogprobs:
    """Tokens ``start:end`` of a completion in the legacy completions shape.

    ``top_logprobs`` holds the token itself and the requested number of most likely tokens (so up
    to ``logprobs + 1`` entries, as the OpenAI API documents); ``text_offset`` counts from
    ``text_offset`` (the length of the text before the first of these tokens).
    """
    result = CompletionLogprobs()
    entries = completion.logprobs or []
    ids = completion.token_ids
    for position in range(start, min(end, len(entries), len(ids))):
        entry = entries[position]
        before = _generated_before(ids, position)
        text_offset = _append_token(result, state, ids[position], entry, len(entry), before, text_offset)
    return result


def _append_token(
    result: CompletionLogprobs,
    state: ServerState,
    token_id: int,
    entry: dict[int, float] | None,
    num_top: int,
    before: Sequence[int],
    text_offset: int,
) -> int:
    """One token of the legacy shape (``entry``: its alternatives, of which the token itself and
    ``num_top`` others are shown; None: a token without logprobs, shown as its own decode, as
    vLLM's); returns where the next token's text starts."""
    result.text_offset.append(text_offset)
    if entry is None:
        text = state.token_text(token_id)
        result.token_logprobs.append(None)
        result.top_logprobs.append(None)
    else:
        text = token_text_after(state, token_id, before)
        result.token_logprobs.append(_finite(entry.get(token_id, _FLOOR)))
        shown = _ordered(entry, token_id)[: num_top + 1]
        top = {token_text_after(state, tid, before): _finite(lp) for tid, lp in shown}
        result.top_logprobs.append(top)
    result.tokens.append(text)
    return text_offset + len(text)


def chat_logprobs(
    state: ServerState, completion: CompletionOutput, start: int, end: int, num_top: int
) -> list[ChatTokenLogprob]:
    """Tokens ``start:end`` of a completion in the chat shape: ``num_top`` alternatives each, the
    token itself first (vLLM's: so a sampled token outside the likeliest is among them)."""
    content: list[ChatTokenLogprob] = []
    entries = completion.logprobs or []
    ids = completion.token_ids
    for position in range(start, min(end, len(entries), len(ids))):
        token_id, entry = ids[position], entries[position]
        before = _generated_before(ids, position)
        text = token_text_after(state, token_id, before)
        ranked = _ordered(entry, token_id)[:num_top]
        texts = [token_text_after(state, tid, before) for tid, _ in ranked]
        top = [
            ChatTopLogprob(token=t, logprob=_finite(lp), bytes=list(t.encode()))
            for t, (_, lp) in zip(texts, ranked, strict=True)
        ]
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=_finite(entry.get(token_id, _FLOOR)),
                bytes=list(text.encode()),
                top_logprobs=top,
            )
        )
    return content


def prompt_logprobs(state: ServerState, final: RequestOutput) -> PromptLogprobs | None:
    """The request's prompt logprobs in vLLM's shape (None for the first token; per later token,
    token id -> logprob, rank and text), or None when it did not ask."""
    if final.prompt_logprobs is None:
        return None
    ids = final.prompt_token_ids
    return [
        None
        if entry is None
        else {
            str(token): PromptLogprob(
                logprob=_finite(value), rank=rank, decoded_token=token_text_after(state, token, _prompt_before(ids, i))
            )
            for token, (value, rank) in entry.items()
        }
        for i, entry in enumerate(final.prompt_logprobs)
    ]


def _prompt_before(ids: Sequence[int], position: int) -> Sequence[int]:
    """The prompt tokens before ``position`` that a prompt token's text may complete (not the first)."""
    return ids[max(1, position - _CONTEXT) : position]


def echoed_prompt_logprobs(state: ServerState, final: RequestOutput, num_top: int) -> CompletionLogprobs:
    """The prompt's tokens in the legacy completions shape, for ``echo`` with ``logprobs`` (vLLM's):
    the first token has none; each later one its logprob and, after the prompt's own token, the
    ``num_top`` most likely tokens of the prompt logprobs (``num_top + 1`` at most)."""
    result = CompletionLogprobs()
    entries = final.prompt_logprobs or []
    text_offset = 0
    ids = final.prompt_token_ids
    for position, token_id in enumerate(ids):
        entry = entries[position] if position < len(entries) else None
        kept = None if entry is None else {tid: value for tid, (value, _) in entry.items()}
        before = _prompt_before(ids, position)
        text_offset = _append_token(result, state, token_id, kept, num_top, before, text_offset)
    return result
