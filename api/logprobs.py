"""Engine logprobs (one ``{token id: logprob}`` per generated token) in the OpenAI shapes."""

from __future__ import annotations

import math

from loraserve.outputs import CompletionOutput, RequestOutput

from .openai_responses import ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs
from .serving import ServerState

_FLOOR = -9999.0  # JSON has no -inf


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


def completion_logprobs(
    state: ServerState, completion: CompletionOutput, start: int, end: int, text_offset: int
) -> CompletionLogprobs:
    """Tokens ``start:end`` of a completion in the legacy completions shape.

    ``top_logprobs`` holds the requested number of most likely tokens plus the sampled one
    (so up to ``logprobs + 1`` entries, as the OpenAI API documents); ``text_offset`` counts
    from ``text_offset`` (the length of the text before the first of these tokens).
    """
    result = CompletionLogprobs()
    entries = completion.logprobs or []
    for position in range(start, min(end, len(entries), len(completion.token_ids))):
        text_offset = _append_token(result, state, completion.token_ids[position], entries[position], text_offset)
    return result


def _append_token(
    result: CompletionLogprobs, state: ServerState, token_id: int, entry: dict[int, float] | None, text_offset: int
) -> int:
    """One token of the legacy shape (``entry``: its alternatives, most likely first once sorted;
    None: a token without logprobs); returns where the next token's text starts."""
    text = state.token_text(token_id)
    result.tokens.append(text)
    result.text_offset.append(text_offset)
    if entry is None:
        result.token_logprobs.append(None)
        result.top_logprobs.append(None)
    else:
        result.token_logprobs.append(_finite(entry.get(token_id, _FLOOR)))
        ranked = sorted(entry.items(), key=lambda item: -item[1])
        result.top_logprobs.append({state.token_text(tid): _finite(lp) for tid, lp in ranked})
    return text_offset + len(text)


def chat_logprobs(
    state: ServerState, completion: CompletionOutput, start: int, end: int, num_top: int
) -> list[ChatTokenLogprob]:
    """Tokens ``start:end`` of a completion in the chat shape (``num_top`` alternatives each)."""
    content: list[ChatTokenLogprob] = []
    entries = completion.logprobs or []
    for position in range(start, min(end, len(entries), len(completion.token_ids))):
        token_id = completion.token_ids[position]
        entry = entries[position]
        text = state.token_text(token_id)
        ranked = sorted(entry.items(), key=lambda item: -item[1])[:num_top]
        top = [
            ChatTopLogprob(token=(t := state.token_text(tid)), logprob=_finite(lp), bytes=list(t.encode()))
            for tid, lp in ranked
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
    return [
        None
        if entry is None
        else {
            str(token): PromptLogprob(logprob=_finite(value), rank=rank, decoded_token=state.token_text(token))
            for token, (value, rank) in entry.items()
        }
        for entry in final.prompt_logprobs
    ]


def echoed_prompt_logprobs(state: ServerState, final: RequestOutput, num_top: int) -> CompletionLogprobs:
    """The prompt's tokens in the legacy completions shape, for ``echo`` with ``logprobs`` (vLLM's):
    the first token has none; each later one its logprob and the ``num_top`` most likely tokens
    of the prompt logprobs, plus the prompt's own token (``num_top + 1`` at most)."""
    result = CompletionLogprobs()
    entries = final.prompt_logprobs or []
    text_offset = 0
    for position, token_id in enumerate(final.prompt_token_ids):
        entry = entries[position] if position < len(entries) else None
        kept = None
        if entry is not None:
            ranked = sorted(entry.items(), key=lambda item: -item[1][0])
            kept = {tid: value for tid, (value, _) in ranked[:num_top]}
            if token_id in entry:
                kept[token_id] = entry[token_id][0]
        text_offset = _append_token(result, state, token_id, kept, text_offset)
    return result
