"""``POST /v1/completions``: the legacy OpenAI text completions endpoint."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request

from loraserve.outputs import CompletionOutput, RequestOutput
from loraserve.sampling_params import SamplingParams

from .async_engine import RequestStream
from .auth import require_api_key
from .errors import APIError
from .logprobs import completion_logprobs, echoed_prompt_logprobs, prompt_logprobs
from .openai_protocol import CompletionRequest
from .openai_responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionResponse,
    ErrorResponse,
    PromptTokensDetails,
    UsageInfo,
)
from .response_modes import answer
from .serving import (
    ServerState,
    check_request_limits,
    get_state,
    new_id,
    output_budgets,
    require_json,
    resolve_adapter,
    sampling_params,
    submit,
)
from .streaming import (
    SSE_DONE,
    DeltaTracker,
    merge_streams,
    sse_error,
    sse_event,
)
from .structured_request import structured_outputs_of

router = APIRouter(tags=["inference"])

MAX_CHOICES = 256  # of a request with several prompts


def max_choices_of(num_prompts: int, max_n: int) -> int:
    """The most choices (prompts x n) a completion request may ask: ``--max-n`` for one prompt."""
    return max_n if num_prompts == 1 else MAX_CHOICES


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
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(item, int) for item in prompt):
        return [[int(item) for item in prompt if isinstance(item, int)]]
    return [item for item in prompt if isinstance(item, str | list)]


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={200: {"content": {"text/event-stream": {}}}, **ERROR_RESPONSES},
    dependencies=[Depends(require_api_key), Depends(require_json)],
    summary="Create a completion (OpenAI-compatible; `stream` for server-sent events)",
)
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    state = get_state(request)
    model = body.model or state.settings.model_id  # vLLM's default, also for an empty name
    adapter_name = resolve_adapter(state, model)
    prompts = _prompts(body.prompt)
    max_choices = max_choices_of(len(prompts), state.settings.max_n)
    if len(prompts) * body.n > max_choices:
        blamed = "n" if len(prompts) == 1 or body.n > 1 else "prompt"  # with n = 1, the prompt count
        raise APIError(400, f"at most {max_choices} choices (prompts x n) per request", param=blamed)
    echo_logprobs = body.echo and body.logprobs is not None  # the prompt's tokens get logprobs too
    # vLLM's prompt scoring (lm-eval-harness's loglikelihood): echo with max_tokens 0 answers the
    # prompt alone, its logprobs too; one token is generated and left out, as vLLM does.
    scoring = body.echo and body.max_tokens == 0
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be at least 1, got 0 (0 only with echo)", param="max_tokens")
    asked = 1 if scoring else body.max_tokens
    echoes = [_prompt_text(state, prompt) for prompt in prompts] if body.echo else [""] * len(prompts)
    token_ids = await _token_ids(state, prompts, body.add_special_tokens)  # tokenized once, here
    lengths = [len(ids) for ids in token_ids]
    # max_tokens: 16 when not sent or sent as null (OpenAI's and vLLM 0.32's default), each prompt's
    # lowered to the room the context leaves after it (vLLM's rule).
    check_request_limits(state, body.n, lengths, asked)
    budgets = output_budgets(state, lengths, asked, 16, "max_tokens", "prompt")
    echoed_logprobs = body.logprobs if echo_logprobs and body.prompt_logprobs is None else None
    defaults = state.settings.sampling_defaults
    constraint = await structured_outputs_of(state, body)
    by_budget = {
        b: sampling_params(
            body, b, body.logprobs, defaults, prompt_logprobs=echoed_logprobs, structured_outputs=constraint
        )
        for b in set(budgets)
    }
    params = [by_budget[budget] for budget in budgets]
    shape = _ChoiceShape(params[0], body.echo, echoes, echo_logprobs, bool(body.return_token_ids), scoring)
    request_id = new_id("cmpl", request, body.request_id)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats)

    def events(streams: list[RequestStream]) -> AsyncIterator[str]:
        return _stream(state, request_id, model, streams, shape, include_usage, continuous)

    def add() -> Awaitable[list[RequestStream]]:
        return submit(state, request_id, token_ids, params, adapter_name, model, body.cache_salt)

    return await answer(
        state, request, add, body.stream, events, lambda finals: _response(state, request_id, model, finals, shape)
    )


async def _token_ids(state: ServerState, prompts: list[str | list[int]], add_special_tokens: bool) -> list[list[int]]:
    """Each prompt's ids: token ids as given (the engine checks them against the vocabulary), texts
    tokenized together (off the event loop when they are long together)."""
    texts = [prompt for prompt in prompts if isinstance(prompt, str)]
    encoded = iter(await state.prompts.encode_many(texts, add_special_tokens))
    return [prompt if isinstance(prompt, list) else next(encoded) for prompt in prompts]


@dataclass(frozen=True)
class _ChoiceShape:
    """What every choice of a request carries besides its text: the echoed prompt (``echoes`` per
    prompt), logprobs (of the prompt too with ``echo_logprobs``), token ids (``return_token_ids``)."""

    params: SamplingParams  # the sampling parameters every prompt shares (all but max_tokens)
    echo: bool
    echoes: list[str]
    echo_logprobs: bool
    return_token_ids: bool
    scoring: bool = False


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
    shape: _ChoiceShape,
) -> CompletionResponse:
    choices: list[CompletionChoice] = []
    n = shape.params.n
    for prompt_index, final in enumerate(finals):
        prefix = shape.echoes[prompt_index]
        prompt_entries = prompt_logprobs(state, final)
        echoed = None
        if shape.echo_logprobs and shape.params.logprobs is not None:
            echoed = echoed_prompt_logprobs(state, final, shape.params.logprobs)
        for completion in final.outputs:
            logprobs = echoed if shape.scoring else None
            if shape.params.logprobs is not None and not shape.scoring:
                offset = len(prefix) if echoed is None else echoed.text_end
                logprobs = completion_logprobs(state, completion, 0, len(completion.token_ids), offset)
                if echoed is not None:  # vLLM's: the prompt's tokens first, the first one without logprobs
                    logprobs = echoed.extended(logprobs)
            choices.append(
                CompletionChoice(
                    index=prompt_index * n + completion.index,
                    text=prefix if shape.scoring else prefix + completion.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    token_ids=list(completion.token_ids) if shape.return_token_ids else None,
                    prompt_logprobs=prompt_entries,
                    prompt_token_ids=list(final.prompt_token_ids) if shape.return_token_ids else None,
                )
            )
    choices.sort(key=lambda choice: choice.index)
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage_for(finals))


class _ChoiceStreamer:
    """Turns successive snapshots of the choices into completion chunks."""

    def __init__(self, state: ServerState, shape: _ChoiceShape) -> None:
        self.state = state
        self.params = shape.params
        self.shape = shape
        self.trackers: dict[int, DeltaTracker] = {}
        self.text_offsets: dict[int, int] = {}
        self.sent: set[int] = set()  # choices whose first chunk went out (return_token_ids: the prompt's ids)
        self.echoed: dict[int, CompletionLogprobs] = {}  # per prompt: its tokens' logprobs (echo + logprobs)

    def choice(
        self, prompt_index: int, output: RequestOutput, completion: CompletionOutput
    ) -> CompletionChunkChoice | None:
        index = prompt_index * self.params.n + completion.index
        tracker = self.trackers.get(index)
        prefix, echoed, opening = "", None, tracker is None
        if tracker is None:
            tracker = self.trackers[index] = DeltaTracker.for_stops(self.params.stop)
            prefix = self.shape.echoes[prompt_index]
            self.text_offsets[index] = len(prefix)
            if self.shape.echo_logprobs and self.params.logprobs is not None:
                # A choice's first snapshot comes with its first token, so after the whole
                # prompt was scored: the prompt's tokens go first, as in vLLM's first chunk.
                if prompt_index not in self.echoed:
                    self.echoed[prompt_index] = echoed_prompt_logprobs(self.state, output, self.params.logprobs)
                echoed = self.echoed[prompt_index]
                self.text_offsets[index] = echoed.text_end
        if tracker.finished:
            return None
        text = prefix + tracker.next_text(completion)
        start, end = tracker.next_token_range(completion)
        finish_reason = completion.finish_reason
        tracker.finished = finish_reason is not None
        logprobs = echoed
        if self.shape.scoring:  # the prompt alone; its one snapshot is the last (max_tokens 1)
            text = prefix
        elif self.params.logprobs is not None and end > start:
            generated = completion_logprobs(self.state, completion, start, end, self.text_offsets[index])
            if generated.tokens:
                self.text_offsets[index] = generated.text_end
            logprobs = generated if echoed is None else echoed.extended(generated)
        if not text and finish_reason is None and end == start and not (opening and self.shape.echo):
            return None  # nothing new (a token whose text is still incomplete still gets its chunk)
        ids = self.shape.return_token_ids
        first = index not in self.sent
        self.sent.add(index)
        return CompletionChunkChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=completion.stop_reason if finish_reason else None,
            # vLLM's: an echoed choice's first chunk carries the prompt's ids, asked for or not
            prompt_token_ids=list(output.prompt_token_ids) if (ids or self.shape.echo) and first else None,
            token_ids=list(completion.token_ids[start:end]) if ids else None,
        )


async def _stream(
    state: ServerState,
    request_id: str,
    model: str,
    streams: list[RequestStream],
    shape: _ChoiceShape,
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    created = int(time.time())
    streamer = _ChoiceStreamer(state, shape)
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async with aclosing(merge_streams(streams)) as merged:
            async for prompt_index, output in merged:
                if output.finished:
                    finals[prompt_index] = output
                for completion in output.outputs:
                    choice = streamer.choice(prompt_index, output, completion)
                    if choice is not None:
                        usage = choice_usage(output, completion) if continuous_usage else None
                        chunk = CompletionChunk(
                            id=request_id, created=created, model=model, choices=[choice], usage=usage
                        )
                        yield sse_event(chunk)
        if include_usage:
            usage = usage_for([final for final in finals if final is not None])
            yield sse_event(CompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage))
    except Exception as error:
        yield sse_error(error)
    finally:
        for stream in streams:
            stream.abort()
    yield SSE_DONE
