"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API over the chat
route's pipeline, text in and out, as vLLM 0.32 serves it for a chat model without tool or
reasoning parsers (``anthropic_input.py`` says what a request becomes).

A reply is one text block; ``stop_reason`` is ``end_turn``, ``max_tokens``, or ``stop_sequence``
with the sequence that matched; ``usage`` splits the prompt as Anthropic does (tokens read from
the prefix cache, tokens written to it, the rest). Streamed, it is Anthropic's event sequence
(``message_start``; ``content_block_start``, a ``content_block_delta`` per piece of text and
``content_block_stop`` once text arrives; ``message_delta`` with the stop reason and usage;
``message_stop``), ``event:`` and ``data:`` lines, no ``[DONE]``; a failure after the start is an
``error`` event. Errors raised here have Anthropic's shape (``{"type": "error", "error": {...}}``
with vLLM's type names); a body that does not validate gets the API's usual 400, as in vLLM."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from loraserve.adapters import RegistryUnavailableError

from loraserve.outputs import CompletionOutput, RequestOutput
from loraserve.sampling_params import SamplingParams

from .anthropic_input import chat_request, refuse_unsupported
from .anthropic_protocol import (
    CountTokensRequest,
    CountTokensResponse,
    ErrorResponse,
    MessageResponse,
    MessagesRequest,
    StopReason,
    TextBlock,
    Usage,
)
from .async_engine import RequestStream
from .auth import require_api_key_or_x_api_key
from .chat_template import render_chat_prompt
from .errors import APIError, error_type_for, registry_unavailable
from .openai_protocol import ChatCompletionRequest
from .response_modes import answer
from .routes_chat import template_variables
from .serving import (
    ServerState,
    check_request_limits,
    get_state,
    output_budgets,
    prefix_cache_writes,
    require_json,
    resolve_adapter,
    sampling_params,
    submit,
)
from .streaming import DeltaTracker, merge_streams, request_error
from .structured_request import structured_outputs_of

router = APIRouter(tags=["inference"])
DEPENDENCIES = [Depends(require_api_key_or_x_api_key), Depends(require_json)]
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 503)
}


def _error(error: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type_for(error.status_code), "message": error.message}}


async def _anthropic_errors(route: Awaitable[Any]) -> Any:
    """The route's result, or its error in Anthropic's shape (vLLM's handler-level errors)."""
    try:
        return await route
    except RegistryUnavailableError as error:
        failure = registry_unavailable(error)
        return JSONResponse(_error(failure), status_code=failure.status_code, headers=failure.headers)
    except APIError as error:
        return JSONResponse(_error(error), status_code=error.status_code, headers=error.headers)


async def _prompt(
    state: ServerState, body: MessagesRequest | CountTokensRequest
) -> tuple[ChatCompletionRequest, list[int]]:
    """The chat request ``body`` stands for and its prompt's token ids (what is not served refused)."""
    refuse_unsupported(body)
    chat = chat_request(body, state.merge_inline_system)
    variables = template_variables(chat)
    continued = chat.continue_final_message
    return chat, await render_chat_prompt(state, chat.messages, not continued, False, continued, variables)


def _stop(completion: CompletionOutput) -> tuple[StopReason | None, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``; none for an aborted output (cut short by
    a drain's deadline or a token its grammar rejected), as vLLM's."""
    if completion.finish_reason == "abort":
        return None, None
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):  # a stop string matched
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _usage(state: ServerState, final: RequestOutput) -> Usage:
    """The counts, the prompt split as Anthropic splits it: read from the cache, written to it, the rest."""
    read, written = final.num_cached_tokens, prefix_cache_writes(state, final)
    return Usage(
        input_tokens=max(0, len(final.prompt_token_ids) - read - written),
        output_tokens=len(final.outputs[0].token_ids),
        cache_read_input_tokens=read,
        cache_creation_input_tokens=written,
    )


@router.post(
    "/v1/messages",
    response_model=MessageResponse,
    responses={200: {"content": {"text/event-stream": {}}}, **ERROR_RESPONSES},
    dependencies=DEPENDENCIES,
    summary="Create a message (Anthropic's Messages API, text; `stream` for server-sent events)",
)
async def create_message(body: MessagesRequest, request: Request) -> Any:
    return await _anthropic_errors(_create_message(body, request))


async def _create_message(body: MessagesRequest, request: Request) -> Any:
    state = get_state(request)
    adapter_name = resolve_adapter(state, body.model)
    chat, prompt_ids = await _prompt(state, body)
    try:
        check_request_limits(state, 1, [len(prompt_ids)], body.max_tokens)
    except APIError as error:
        error.param = {"prompt": "messages"}.get(error.param or "", error.param)
        raise
    default = state.settings.default_max_tokens
    (max_tokens,) = output_budgets(state, [len(prompt_ids)], body.max_tokens, default, "max_tokens", "messages")
    try:
        constraint = await structured_outputs_of(state, chat)
    except APIError as error:
        message = error.message.replace("structured_outputs.json:", "output_config.format.schema:")
        raise APIError(400, message, param="output_config") from None
    params = sampling_params(chat, max_tokens, None, state.settings.sampling_defaults, structured_outputs=constraint)
    message_id = f"msg_{request.headers.get('x-request-id') or uuid.uuid4().hex[:24]}"  # X-Request-Id, as vLLM

    def whole(finals: list[RequestOutput]) -> dict[str, Any]:
        (final,) = finals
        completion = final.outputs[0]
        reason, sequence = _stop(completion)
        return MessageResponse(
            id=message_id,
            content=[TextBlock(text=completion.text)],
            model=body.model,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=_usage(state, final),
        ).model_dump(mode="json")

    def add() -> Awaitable[list[RequestStream]]:
        return submit(state, message_id, [prompt_ids], [params], adapter_name, body.model, body.cache_salt)

    def events(streams: list[RequestStream]) -> AsyncIterator[str]:
        return _events(state, streams[0], params, message_id, body.model, len(prompt_ids))

    return await answer(state, request, add, bool(body.stream), events, whole)


def _event(kind: str, **fields: Any) -> str:
    """One server-sent event: its ``event:`` line and its data, whose ``type`` is the event's."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n"


async def _events(
    state: ServerState, stream: RequestStream, params: SamplingParams, message_id: str, model: str, prompt: int
) -> AsyncIterator[str]:
    """The event sequence of one streamed message (the module's docstring)."""
    event = _event
    tracker = DeltaTracker.for_stops(params.stop)
    opened = False
    final: RequestOutput | None = None
    try:
        usage = Usage(input_tokens=prompt, output_tokens=0)  # the split of the prompt is known at the end
        start = MessageResponse(id=message_id, content=[], model=model, stop_reason=None, usage=usage)
        yield event("message_start", message=start.model_dump(mode="json"))
        async with aclosing(merge_streams([stream])) as merged:
            async for _, output in merged:
                completion = output.outputs[0]
                delta = tracker.next_text(completion)
                if completion.finish_reason is not None:
                    final = output
                if not delta:
                    continue
                if not opened:  # the text block starts with its first text, as vLLM's
                    opened = True
                    yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": delta})
        if final is None:
            raise RuntimeError("the request's stream ended before it finished")
        if opened:
            yield event("content_block_stop", index=0)
        reason, sequence = _stop(final.outputs[0])
        counts = _usage(state, final).model_dump()
        yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=counts)
        yield event("message_stop")
    except Exception as error:
        yield event("error", error=_error(request_error(error))["error"])
    finally:
        stream.abort()


@router.post(
    "/v1/messages/count_tokens",
    response_model=CountTokensResponse,
    responses=ERROR_RESPONSES,
    dependencies=DEPENDENCIES,
    summary="Count a message request's prompt tokens (Anthropic's Messages API)",
)
async def count_tokens(body: CountTokensRequest, request: Request) -> Any:
    return await _anthropic_errors(_count_tokens(body, request))


async def _count_tokens(body: CountTokensRequest, request: Request) -> dict[str, Any]:
    state = get_state(request)
    resolve_adapter(state, body.model)
    _, prompt_ids = await _prompt(state, body)
    count = len(prompt_ids)
    return CountTokensResponse(input_tokens=count, context_management={"original_input_tokens": count}).model_dump()
