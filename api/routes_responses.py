"""``POST /v1/responses``: OpenAI's Responses API over the chat route's pipeline, text in and out,
as vLLM 0.32 serves it for a chat model without tool or reasoning parsers. Nothing is stored
(vLLM's default): ``GET /v1/responses/{id}`` and its ``cancel`` answer 404 for every id.

The response is ``completed``, or ``incomplete`` (``max_output_tokens``) when the output ran out
of tokens; streamed, it is vLLM's event sequence (``response.created``, ``response.in_progress``,
the message item's ``added`` events when its first text arrives, ``response.output_text.delta``
per piece of text, the ``done`` events, ``response.completed``), each ``event:`` and ``data:``
lines with a ``sequence_number`` from 0, and no ``[DONE]``."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request

from loraserve.outputs import CompletionOutput, RequestOutput
from loraserve.sampling_params import SamplingParams

from .async_engine import RequestStream
from .auth import require_api_key
from .chat_template import render_chat_prompt
from .errors import APIError
from .logprobs import chat_logprobs
from .openai_responses import ChatTokenLogprob
from .response_modes import answer
from .responses_input import chat_request, refuse_unsupported
from .responses_protocol import (
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from .routes_chat import template_variables
from .routes_completions import ERROR_RESPONSES
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
from .streaming import (
    DeltaTracker,
    merge_streams,
    request_error,
)
from .structured_request import structured_outputs_of

router = APIRouter(tags=["inference"])
Status = Literal["in_progress", "completed", "incomplete"]


@dataclass(frozen=True)
class _Reply:
    """What a response says besides its output: the request's settings as they took effect."""

    body: ResponsesRequest
    response_id: str
    model: str
    created_at: int
    params: SamplingParams

    def response(self, status: Status, output: list[OutputMessage], usage: ResponseUsage | None) -> ResponseObject:
        body, params = self.body, self.params
        return ResponseObject(
            id=self.response_id,
            created_at=self.created_at,
            status=status,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            model=self.model,
            output=output,
            usage=usage,
            instructions=body.instructions,
            metadata=body.metadata,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            temperature=params.temperature,
            tool_choice="none" if body.tool_choice == "auto" else body.tool_choice,  # vLLM's, without tools
            tools=[],
            top_p=1.0 if params.temperature == 0 else params.top_p,  # vLLM's for greedy sampling
            max_output_tokens=params.max_tokens,
            max_tool_calls=body.max_tool_calls,
            reasoning=body.reasoning,
            service_tier=body.service_tier,
            text=body.text,
            top_logprobs=params.logprobs,
            truncation=body.truncation or "disabled",
            user=body.user,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
        )

    def logprobs(
        self, state: ServerState, completion: CompletionOutput, start: int, end: int
    ) -> list[ChatTokenLogprob]:
        if self.params.logprobs is None:
            return []
        return chat_logprobs(state, completion, start, end, self.params.logprobs)


def _status(completion: CompletionOutput) -> Status:
    return "incomplete" if completion.finish_reason == "length" else "completed"


def _usage(state: ServerState, final: RequestOutput) -> ResponseUsage:
    """Token counts, the prefix cache's reads and writes among the prompt's."""
    prompt, output = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
    writes = prefix_cache_writes(state, final)
    cached = InputTokensDetails(cached_tokens=final.num_cached_tokens, cache_write_tokens=writes)
    return ResponseUsage(
        input_tokens=prompt, input_tokens_details=cached, output_tokens=output, total_tokens=prompt + output
    )


def _item_id() -> str:
    return f"msg_{uuid.uuid4().hex[:16]}"


@router.post(
    "/v1/responses",
    response_model=ResponseObject,
    responses={200: {"content": {"text/event-stream": {}}}, **ERROR_RESPONSES},
    dependencies=[Depends(require_api_key), Depends(require_json)],
    summary="Create a model response (OpenAI's Responses API, text; `stream` for server-sent events)",
)
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    state = get_state(request)
    model = body.model or state.settings.model_id
    adapter_name = resolve_adapter(state, model)
    refuse_unsupported(body)
    chat = chat_request(body)
    prompt_ids = await render_chat_prompt(
        state, chat.messages, chat.add_generation_prompt, False, chat.continue_final_message, template_variables(chat)
    )
    try:
        check_request_limits(state, 1, [len(prompt_ids)], body.max_output_tokens)
    except APIError as error:  # named as this API names them
        error.param = {"max_tokens": "max_output_tokens", "prompt": "input"}.get(error.param or "", error.param)
        raise
    default = state.settings.default_max_tokens
    (max_tokens,) = output_budgets(
        state, [len(prompt_ids)], body.max_output_tokens, default, "max_output_tokens", "input"
    )
    try:
        constraint = await structured_outputs_of(state, chat)
    except APIError as error:
        if body.structured_outputs:
            raise
        message = error.message.replace("structured_outputs.json:", "text.format.schema:")
        raise APIError(400, message.replace("structured_outputs", "text.format"), param="text") from None
    logprobs = body.top_logprobs if chat.logprobs else None
    params = sampling_params(
        chat, max_tokens, logprobs, state.settings.sampling_defaults, structured_outputs=constraint
    )
    reply = _Reply(body, body.request_id or f"resp_{uuid.uuid4().hex}", model, int(time.time()), params)

    def whole(finals: list[RequestOutput]) -> dict[str, Any]:
        (final,) = finals
        completion = final.outputs[0]
        logprobs = (
            reply.logprobs(state, completion, 0, len(completion.token_ids)) if params.logprobs is not None else None
        )
        content = [OutputText(text=completion.text, logprobs=logprobs)] if completion.text else []
        output = [OutputMessage(id=_item_id(), content=content)]
        return reply.response(_status(completion), output, _usage(state, final)).model_dump(mode="json")

    def add() -> Awaitable[list[RequestStream]]:
        return submit(state, reply.response_id, [prompt_ids], [params], adapter_name, model, body.cache_salt)

    return await answer(state, request, add, body.stream, lambda streams: _events(state, streams[0], reply), whole)


def _event_writer() -> Callable[..., str]:
    """``event(type, **fields)``: one SSE event, numbered from 0 in the order written."""
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        data = {**fields, "sequence_number": next(numbers), "type": kind}
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    return event


async def _events(state: ServerState, stream: RequestStream, reply: _Reply) -> AsyncIterator[str]:
    """The event sequence. Tokens without text of their own (EOS, the first bytes of a character)
    pass their logprobs to the next delta; the finished part holds every token's (vLLM's streamed
    part drops those that never reach a delta)."""
    event = _event_writer()
    tracker = DeltaTracker.for_stops(reply.params.stop)
    item = OutputMessage(id=_item_id(), status="in_progress")
    place = {"item_id": item.id, "output_index": 0, "content_index": 0}
    text, logprobs, pending = "", list[ChatTokenLogprob](), list[ChatTokenLogprob]()
    opened = False
    final: RequestOutput | None = None
    try:
        started = reply.response("in_progress", [], None).model_dump(mode="json")
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        async with aclosing(merge_streams([stream])) as merged:
            async for _, output in merged:
                completion = output.outputs[0]
                delta = tracker.next_text(completion)
                start, end = tracker.next_token_range(completion)
                pending += reply.logprobs(state, completion, start, end)
                if completion.finish_reason is not None:
                    final = output
                if not delta:
                    continue
                if not opened:  # the item's events start with its first text, as vLLM's
                    opened = True
                    yield event("response.output_item.added", item=item.model_dump(mode="json"), output_index=0)
                    empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    yield event("response.content_part.added", part=empty, **place)
                shown = [
                    entry.model_dump(exclude={"bytes": True, "top_logprobs": {"__all__": {"bytes"}}})
                    for entry in pending
                ]
                yield event("response.output_text.delta", delta=delta, logprobs=shown, **place)
                text, logprobs, pending = text + delta, logprobs + pending, []
        if final is None:
            raise RuntimeError("the request's stream ended before it finished")
        output_items = []
        if opened:
            yield event("response.output_text.done", text=text, logprobs=[], **place)
            part = OutputText(text=text, logprobs=logprobs + pending if reply.params.logprobs is not None else None)
            yield event("response.content_part.done", part=part.model_dump(mode="json"), **place)
            done = OutputMessage(id=item.id, content=[part])
            yield event("response.output_item.done", item=done.model_dump(mode="json"), output_index=0)
            output_items = [done]
        response = reply.response(_status(final.outputs[0]), output_items, _usage(state, final))
        yield event("response.completed", response=response.model_dump(mode="json"))
    except Exception as error:
        failure = request_error(error)
        yield event("error", code=str(failure.status_code), message=failure.message, param=failure.param)
    finally:
        stream.abort()


@router.get("/v1/responses/{response_id}", dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES)
async def retrieve_response(response_id: str) -> Any:
    """Nothing is stored (vLLM's default, without ``VLLM_ENABLE_RESPONSES_API_STORE``): 404."""
    raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")


@router.post("/v1/responses/{response_id}/cancel", dependencies=[Depends(require_api_key)], responses=ERROR_RESPONSES)
async def cancel_response(response_id: str) -> Any:
    """Only background responses can be cancelled, and none is kept: 404."""
    raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")
