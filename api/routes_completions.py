"""``POST /v1/completions``: the legacy OpenAI text completions endpoint."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from loraserve.outputs import CompletionOutput, RequestOutput
from loraserve.sampling_params import SamplingParams

from .async_engine import RequestStream
from .auth import require_api_key
from .errors import APIError
from .limits import InFlightLimiter
from .logprobs import completion_logprobs, prompt_logprobs
from .openai_protocol import CompletionRequest
from .openai_responses import CompletionChoice, CompletionResponse, ErrorResponse, PromptTokensDetails, UsageInfo
from .serving import (
    ServerState,
    check_request_limits,
    get_state,
    limited_max_tokens,
    new_id,
    resolve_adapter,
    sampling_params,
    submit,
)
from .streaming import (
    SSE_DONE,
    ClientDisconnectedError,
    DeltaTracker,
    SSEResponse,
    cancel_on_disconnect,
    collect_final,
    merge_streams,
    sse_error,
    sse_event,
)

router = APIRouter(tags=["inference"])

MAX_CHOICES = 256
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 503)}


def usage_for(finals: list[RequestOutput]) -> UsageInfo:
    """Token counts of finished requests (each prompt counted once, however many samples)."""
    return _usage(
        sum(len(final.prompt_token_ids) for final in finals),
        sum(len(c.token_ids) for final in finals for c in final.outputs),
        sum(final.num_cached_tokens for final in finals),
    )


def choice_usage(output: RequestOutput, completion: CompletionOutput) -> UsageInfo:
    """Token counts so far of one choice (``continuous_usage_stats``, as vLLM's: its prompt, and
    that sample's tokens only, not its siblings')."""
    return _usage(len(output.prompt_token_ids), len(completion.token_ids), output.num_cached_tokens)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if all(isinstance(item, int) for item in prompt):
        return [[int(item) for item in prompt if isinstance(item, int)]]
    return [item for item in prompt if isinstance(item, str | list)]


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={200: {"content": {"text/event-stream": {}}}, **ERROR_RESPONSES},
    dependencies=[Depends(require_api_key)],
    summary="Create a completion (OpenAI-compatible; `stream` for server-sent events)",
)
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    state = get_state(request)
    model = body.model if body.model is not None else state.settings.model_id  # vLLM's default
    adapter_name = resolve_adapter(state, model)
    prompts = _prompts(body.prompt)
    if not body.add_special_tokens:  # texts tokenized here, without the special tokens the engine would add
        prompts = [state.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else p for p in prompts]
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} choices (prompts x n) per request", param="n")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported (no prompt logprobs)", param="echo")
    # max_tokens: 16 when not sent (OpenAI's and vLLM's default); sent as null, up to the context
    # left after the longest prompt (vLLM's rule).
    up_to_context = "max_tokens" in body.model_fields_set and body.max_tokens is None
    measured = up_to_context or state.settings.max_prompt_tokens is not None
    lengths = [_prompt_length(state, p) for p in prompts] if measured else []
    asked = body.max_tokens if "max_tokens" in body.model_fields_set else None
    check_request_limits(state, body.n, lengths, asked)
    default = state.max_new_tokens(max(lengths)) if up_to_context else 16
    params = sampling_params(body, asked or limited_max_tokens(state, default), body.logprobs)
    request_id = new_id("cmpl")
    echoes = [_prompt_text(state, prompt) for prompt in prompts] if body.echo else [""] * len(prompts)
    key = InFlightLimiter.key_of(request.headers.get("authorization"))
    state.in_flight.acquire(key)  # 429 past the limit
    if body.stream:
        try:
            streams = await submit(state, request_id, prompts, params, adapter_name, model, body.cache_salt)
        except BaseException:
            state.in_flight.release(key)
            raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats)
        events = _stream(state, request_id, model, streams, params, echoes, include_usage, continuous)
        return SSEResponse(events, on_close=lambda: state.in_flight.release(key))

    async def complete() -> CompletionResponse:
        streams = await submit(state, request_id, prompts, params, adapter_name, model, body.cache_salt)
        finals = await collect_final(streams)
        return _response(state, request_id, model, finals, params, echoes)

    try:
        return await cancel_on_disconnect(request, complete())
    except ClientDisconnectedError:
        return Response(status_code=499)
    finally:
        state.in_flight.release(key)


def _prompt_length(state: ServerState, prompt: str | list[int]) -> int:
    return len(prompt) if isinstance(prompt, list) else len(state.tokenizer.encode(prompt))


def _prompt_text(state: ServerState, prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    vocab = int(state.engine.hf_config.vocab_size)
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:  # the engine refuses them too, but echo decodes them first
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
    return str(state.tokenizer.decode(prompt))


def _response(
    state: ServerState,
    request_id: str,
    model: str,
    finals: list[RequestOutput],
    params: SamplingParams,
    echoes: list[str],
) -> CompletionResponse:
    choices: list[CompletionChoice] = []
    for prompt_index, final in enumerate(finals):
        prefix = echoes[prompt_index]
        prompt_entries = prompt_logprobs(state, final)
        for completion in final.outputs:
            logprobs = None
            if params.logprobs is not None:
                logprobs = completion_logprobs(state, completion, 0, len(completion.token_ids), len(prefix))
            choices.append(
                CompletionChoice(
                    index=prompt_index * params.n + completion.index,
                    text=prefix + completion.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    prompt_logprobs=prompt_entries,
                )
            )
    choices.sort(key=lambda choice: choice.index)
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage_for(finals))


class _ChoiceStreamer:
    """Turns successive snapshots of the choices into completion chunks."""

    def __init__(self, state: ServerState, params: SamplingParams, echoes: list[str]) -> None:
        self.state = state
        self.params = params
        self.echoes = echoes
        self.trackers: dict[int, DeltaTracker] = {}
        self.text_offsets: dict[int, int] = {}

    def choice(self, prompt_index: int, completion: CompletionOutput) -> CompletionChoice | None:
        index = prompt_index * self.params.n + completion.index
        tracker = self.trackers.get(index)
        prefix = ""
        if tracker is None:
            tracker = self.trackers[index] = DeltaTracker.for_stops(self.params.stop)
            prefix = self.echoes[prompt_index]
            self.text_offsets[index] = len(prefix)
        if tracker.finished:
            return None
        text = prefix + tracker.next_text(completion)
        start, end = tracker.next_token_range(completion)
        finish_reason = completion.finish_reason
        tracker.finished = finish_reason is not None
        logprobs = None
        if self.params.logprobs is not None and end > start:
            logprobs = completion_logprobs(self.state, completion, start, end, self.text_offsets[index])
            self.text_offsets[index] += sum(len(token) for token in logprobs.tokens)
        if not text and finish_reason is None and end == start:
            return None  # nothing new (a token whose text is still incomplete still gets its chunk)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=completion.stop_reason if finish_reason else None,
        )


async def _stream(
    state: ServerState,
    request_id: str,
    model: str,
    streams: list[RequestStream],
    params: SamplingParams,
    echoes: list[str],
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    created = int(time.time())
    streamer = _ChoiceStreamer(state, params, echoes)
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async with aclosing(merge_streams(streams)) as merged:
            async for prompt_index, output in merged:
                if output.finished:
                    finals[prompt_index] = output
                for completion in output.outputs:
                    choice = streamer.choice(prompt_index, completion)
                    if choice is not None:
                        usage = choice_usage(output, completion) if continuous_usage else None
                        chunk = CompletionResponse(
                            id=request_id, created=created, model=model, choices=[choice], usage=usage
                        )
                        yield sse_event(chunk)
        if include_usage:
            usage = usage_for([final for final in finals if final is not None])
            yield sse_event(CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage))
    except Exception as error:
        yield sse_error(error)
    finally:
        for stream in streams:
            stream.abort()
    yield SSE_DONE
