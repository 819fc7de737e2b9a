"""``POST /v1/chat/completions/batch``: several conversations in one request, as vLLM 0.32 serves
it. The body is a chat completion request whose ``messages`` is a list of conversations; each is
rendered through the chat template and generated as an engine request of its own (all added in one
submission, so they share the running batch), and the reply is one chat completion whose choice
``i`` answers conversation ``i`` and whose usage sums theirs. Sampling fields apply to every
conversation (a ``seed`` to each alike, as vLLM's). As in vLLM, ``n`` must be 1 and tools are
refused; what vLLM's batch route does not serve and silently ignores (``stream``,
``prompt_logprobs``) is refused here by name, as are more than 256 conversations."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, NoReturn

from fastapi import APIRouter, Depends, Request

from loraserve.outputs import RequestOutput

from .async_engine import RequestStream
from .auth import require_api_key
from .chat_template import render_chat_prompt
from .errors import APIError
from .openai_protocol import BatchChatCompletionRequest, ChatMessage
from .openai_responses import ChatChoice, ChatCompletionResponse, ChatResponseMessage
from .response_modes import answer
from .routes_chat import chat_sampling_params, choice_logprobs, echoed_content, template_variables
from .routes_completions import ERROR_RESPONSES, MAX_CHOICES, usage_for
from .serving import (
    ServerState,
    get_state,
    new_id,
    require_json,
    resolve_adapter,
    submit,
)

router = APIRouter(tags=["inference"])


def _refuse_unserved(body: BatchChatCompletionRequest) -> None:
    if body.n != 1:  # vLLM's rule and message
        raise APIError(400, "Batch chat completions do not support `n > 1`. Please set `n` to 1.", param="n")
    if body.stream:
        raise APIError(400, "stream is not supported by batch chat completions", param="stream")
    if body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs is not supported by batch chat completions", param="prompt_logprobs")
    if len(body.messages) > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} conversations per request", param="messages")
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
    if body.tools is not None or body.tool_choice not in (None, "none"):  # vLLM's field takes "none" only
        param = "tools" if body.tools is not None else "tool_choice"
        raise APIError(400, f"{param} is not supported by batch chat completions", param=param)


async def _render(state: ServerState, index: int, chat: list[ChatMessage], options: tuple[Any, ...]) -> list[int]:
    """A conversation's prompt ids; an error names the conversation (``messages.<index>``) too."""
    try:
        return await render_chat_prompt(state, chat, *options)
    except APIError as error:
        where = f"messages.{index}"
        param = error.param if isinstance(error.param, str) else ""
        error.param = where + param.removeprefix("messages") if param.startswith("messages") else where
        error.message = f"{where}: {error.message}"
        raise


@router.post(
    "/v1/chat/completions/batch",
    response_model=ChatCompletionResponse,
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_api_key), Depends(require_json)],
    summary="Several conversations in one request, one choice each (vLLM's batch chat completions)",
)
async def create_batch_chat_completion(body: BatchChatCompletionRequest, request: Request) -> Any:
    state = get_state(request)
    model = body.model or state.settings.model_id  # vLLM's default, also for an empty name
    adapter_name = resolve_adapter(state, model)
    _refuse_unserved(body)
    variables = template_variables(body)
    options = (body.add_generation_prompt, body.add_special_tokens, body.continue_final_message, variables)
    prompt_ids = [await _render(state, index, chat, options) for index, chat in enumerate(body.messages)]
    params = await chat_sampling_params(state, body, [len(ids) for ids in prompt_ids])
    # vLLM's: a reply takes its conversation's last role unless a generation prompt starts a new turn.
    roles = ["assistant" if body.add_generation_prompt else conversation[-1].role for conversation in body.messages]
    conversations = zip(body.messages, roles, strict=True)
    echoes = [echoed_content(conversation, role) if body.echo else "" for conversation, role in conversations]
    request_id = new_id("chatcmpl", request, body.request_id)
    num_top = body.top_logprobs or 0

    def whole(finals: list[RequestOutput]) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=index,
                message=ChatResponseMessage(role=roles[index], content=echoes[index] + completion.text),
                logprobs=choice_logprobs(state, completion, 0, len(completion.token_ids), params[index], num_top),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                token_ids=list(completion.token_ids) if body.return_token_ids else None,
            )
            for index, final in enumerate(finals)
            for completion in final.outputs
        ]
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage_for(finals))

    def no_events(_: list[RequestStream]) -> NoReturn:
        raise AssertionError("a batch chat completion is never streamed (refused above)")

    def add() -> Awaitable[list[RequestStream]]:
        return submit(state, request_id, prompt_ids, params, adapter_name, model, body.cache_salt)

    return await answer(state, request, add, False, no_events, whole)
