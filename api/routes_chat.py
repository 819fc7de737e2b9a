"""``POST /v1/chat/completions``: chat through the base model's chat template."""

from __future__ import annotations

import logging
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
from .chat_template import message_dict, render_chat_prompt
from .errors import APIError
from .logprobs import chat_logprobs, prompt_logprobs
from .openai_protocol import ChatCompletionRequest, ChatFields, ChatMessage
from .openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    UsageInfo,
)
from .response_modes import answer
from .routes_completions import ERROR_RESPONSES, choice_usage, usage_for
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

logger = logging.getLogger(__name__)

router = APIRouter(tags=["inference"])


def template_variables(body: ChatFields) -> dict[str, Any] | None:
    """The chat template's extra variables: ``chat_template_kwargs``, and ``reasoning_effort`` with
    ``enable_thinking`` (false for ``none``) where the client sets an effort and not that
    variable, as vLLM hands them over (a template that does not read them ignores them)."""
    if body.reasoning_effort is None:
        return body.chat_template_kwargs
    effort = {"reasoning_effort": body.reasoning_effort, "enable_thinking": body.reasoning_effort != "none"}
    return {**effort, **(body.chat_template_kwargs or {})}


async def chat_sampling_params(state: ServerState, body: ChatFields, prompt_lengths: list[int]) -> list[SamplingParams]:
    """Each prompt's sampling parameters: the body's, the server's limits checked, ``max_tokens``
    lowered to the room each prompt leaves in the context (vLLM's rule)."""
    asked = body.max_completion_tokens or body.max_tokens
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    check_request_limits(state, body.n, prompt_lengths, asked)
    default = state.settings.default_max_tokens
    budgets = output_budgets(state, prompt_lengths, asked, default, field, "messages")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    constraint = await structured_outputs_of(state, body)
    defaults = state.settings.sampling_defaults
    by_budget = {b: sampling_params(body, b, logprobs, defaults, structured_outputs=constraint) for b in set(budgets)}
    return [by_budget[budget] for budget in budgets]


def echoed_content(messages: list[ChatMessage], role: str) -> str:
    """What a reply starts with under ``echo``: the last message's content when it has the reply's role (vLLM's)."""
    last = messages[-1]
    return str(message_dict(last, len(messages) - 1)["content"]) if last.role == role else ""


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={200: {"content": {"text/event-stream": {}}}, **ERROR_RESPONSES},
    dependencies=[Depends(require_api_key), Depends(require_json)],
    summary="Create a chat completion (OpenAI-compatible; `stream` for server-sent events)",
)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    state = get_state(request)
    model = body.model or state.settings.model_id  # vLLM's default, also for an empty name
    adapter_name = resolve_adapter(state, model)
    if body.top_logprobs and not body.logprobs:  # 0 is vLLM's default, sent by some clients
        raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
    if body.tool_choice not in (None, "none") and body.tools is None:  # vLLM's rule and message
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if body.tools == []:  # vLLM's (and OpenAI's) rule
        raise APIError(
            400,
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            param="tools",
        )
    prompt_ids = await render_chat_prompt(
        state,
        body.messages,
        body.add_generation_prompt,
        body.add_special_tokens,
        body.continue_final_message,
        template_variables(body),
    )
    (params,) = await chat_sampling_params(state, body, [len(prompt_ids)])
    num_top = body.top_logprobs or 0
    # vLLM's: the reply takes the last message's role unless a generation prompt starts a new
    # assistant turn; ``echo`` starts its content with the last message's when their roles match.
    role = "assistant" if body.add_generation_prompt else body.messages[-1].role
    echo = echoed_content(body.messages, role) if body.echo else ""
    reply = _Reply(role, echo, num_top, len(prompt_ids), prompt_ids if body.return_token_ids else None)
    request_id = new_id("chatcmpl", request, body.request_id)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats)

    def events(streams: list[RequestStream]) -> AsyncIterator[str]:
        return _stream(state, request_id, model, streams[0], params, reply, include_usage, continuous)

    def whole(finals: list[RequestOutput]) -> ChatCompletionResponse:
        (final,) = finals
        choices = [
            ChatChoice(
                index=completion.index,
                message=ChatResponseMessage(role=role, content=echo + completion.text),
                logprobs=choice_logprobs(state, completion, 0, len(completion.token_ids), params, num_top),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                token_ids=list(completion.token_ids) if body.return_token_ids else None,
            )
            for completion in final.outputs
        ]
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=usage_for([final]),
            prompt_logprobs=prompt_logprobs(state, final),
            prompt_token_ids=prompt_ids if body.return_token_ids else None,
        )

    def add() -> Awaitable[list[RequestStream]]:
        return submit(state, request_id, [prompt_ids], [params], adapter_name, model, body.cache_salt)

    return await answer(state, request, add, body.stream, events, whole)


def choice_logprobs(
    state: ServerState, completion: CompletionOutput, start: int, end: int, params: SamplingParams, num_top: int
) -> ChatLogprobs | None:
    if params.logprobs is None:
        return None
    return ChatLogprobs(content=chat_logprobs(state, completion, start, end, num_top))


@dataclass(frozen=True)
class _Reply:
    """What every choice of a chat reply carries besides its text."""

    role: str
    echo: str  # the last message's content that the reply starts with ("" without echo)
    num_top: int  # top_logprobs
    num_prompt_tokens: int
    prompt_token_ids: list[int] | None  # return_token_ids: sent in the first chunks; each chunk's ids too


async def _stream(
    state: ServerState,
    request_id: str,
    model: str,
    stream: RequestStream,
    params: SamplingParams,
    reply: _Reply,
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    created = int(time.time())
    prompt_token_ids, num_top = reply.prompt_token_ids, reply.num_top
    with_ids = prompt_token_ids is not None

    def chunk(choices: list[ChatChunkChoice], usage: Any = None, prompt_ids: list[int] | None = None) -> str:
        return sse_event(
            ChatCompletionChunk(
                id=request_id, created=created, model=model, choices=choices, usage=usage, prompt_token_ids=prompt_ids
            )
        )

    trackers = [DeltaTracker.for_stops(params.stop) for _ in range(params.n)]
    final: RequestOutput | None = None
    try:
        # vLLM's: with continuous usage the opening chunks count the prompt (nothing cached known yet)
        prompt_only = UsageInfo(prompt_tokens=reply.num_prompt_tokens, total_tokens=reply.num_prompt_tokens)
        opening_usage = prompt_only if continuous_usage else None
        for index in range(params.n):  # one chunk per choice, as vLLM sends them
            opening = ChatChunkChoice(index=index, delta=ChatDelta(role=reply.role, content=""))
            yield chunk([opening], opening_usage, prompt_token_ids)
        for index in range(params.n if reply.echo else 0):
            yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=reply.echo))], opening_usage)
        async with aclosing(merge_streams([stream])) as merged:
            async for _, output in merged:
                final = output if output.finished else None
                for completion in output.outputs:
                    tracker = trackers[completion.index]
                    if tracker.finished:
                        continue
                    text = tracker.next_text(completion)
                    start, end = tracker.next_token_range(completion)
                    tracker.finished = completion.finish_reason is not None
                    logprobs = choice_logprobs(state, completion, start, end, params, num_top) if end > start else None
                    if not text and not tracker.finished and end == start:
                        continue  # nothing new (a token whose text is still incomplete still gets its chunk)
                    delta = ChatDelta(content=text)
                    choice = ChatChunkChoice(
                        index=completion.index,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason if completion.finish_reason else None,
                        token_ids=list(completion.token_ids[start:end]) if with_ids else None,
                    )
                    yield chunk([choice], choice_usage(output, completion) if continuous_usage else None)
        if include_usage and final is not None:
            yield chunk([], usage_for([final]))
    except Exception as error:
        yield sse_error(error)
    finally:
        stream.abort()
    yield SSE_DONE
