"""A ``/v1/responses`` request as the chat completion it asks for, as vLLM 0.32 reads it for a chat
model without tool or reasoning parsers: ``instructions`` a leading system message, ``input`` the
messages (text parts of a message joined by newlines), an assistant message left ``in_progress``
or ``incomplete`` at the end continued rather than answered, ``text.format`` a structured output,
``include`` of the output's logprobs turning logprobs on. What the chat route cannot honour here
(tools, stored responses, background runs, prompt templates, truncation) is refused by name."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .errors import APIError
from .openai_protocol import ChatCompletionRequest, ChatMessage
from .responses_protocol import LOGPROBS_INCLUDE, ResponsesRequest

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}  # type -> key
UNFINISHED = ("in_progress", "incomplete")  # an assistant message in these states is continued


def refuse_unsupported(body: ResponsesRequest) -> None:
    """400 (404 for a previous response: none is ever stored, vLLM's default) for what loraserve
    does not serve, with vLLM's messages where vLLM refuses the same."""
    refused = [name for name in body.REFUSED if getattr(body, name) not in (None, False, {}, [])]
    if refused:
        raise APIError(400, f"unsupported parameter(s) {refused}: loraserve does not implement them", param=refused[0])
    if body.background:
        message = "background can only be used when `store` is true" if not body.store else (
            "background mode needs stored responses, which loraserve does not keep"
        )  # fmt: skip
        raise APIError(400, message, param="background")
    if body.previous_response_id is not None:
        raise APIError(404, f"Response with id '{body.previous_response_id}' not found.", param="response_id")
    if body.prompt is not None:
        raise APIError(400, "prompt template is not supported", param="prompt")
    if body.tools:
        raise APIError(400, "tools are not supported: loraserve has no tool-call parser", param="tools")
    if body.tool_choice == "required":  # vLLM's rule and message
        raise APIError(400, "Tool choice 'required' must be specified with 'tools' parameter.", param="tool_choice")
    if isinstance(body.tool_choice, dict):
        kind = body.tool_choice.get("type", "function")
        raise APIError(400, f"Tool choice '{kind}' not found in 'tools' parameter.", param="tool_choice")
    if body.truncation == "auto":
        raise APIError(400, "truncation 'auto' is not supported: the input is never cut", param="truncation")
    if body.structured_outputs and body.text is not None and body.text.format is not None:
        raise APIError(400, "Cannot specify both structured_outputs and text.format", param="structured_outputs")


def _content(item: dict[str, Any], index: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(
            400, f"input[{index}].content must be a string or a list of parts", param=f"input.{index}.content"
        )
    texts = []
    for number, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = TEXT_PARTS.get(str(kind))
        value = part.get(key) if key is not None and isinstance(part, dict) else None
        if not isinstance(value, str):
            where = f"input.{index}.content.{number}"
            raise APIError(400, f"{where}: only text parts are supported, got {kind!r}", param=where)
        texts.append(value)
    return "\n".join(texts)


def input_messages(body: ResponsesRequest) -> tuple[list[ChatMessage], bool]:
    """The chat messages, and whether the last one (an unfinished assistant message) is continued."""
    messages = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        return [*messages, ChatMessage(role="user", content=body.input)], False
    for index, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind != "message":
            where = f"input.{index}.type"
            raise APIError(400, f"input item type {kind!r} is not supported: only messages", param=where)
        role = item.get("role")
        if role not in ROLES:
            raise APIError(
                400, f"input[{index}].role must be one of {list(ROLES)}, got {role!r}", param=f"input.{index}.role"
            )
        messages.append(ChatMessage(role=role, content=_content(item, index)))
    if not body.input:
        raise APIError(400, "input must hold at least one message", param="input")
    last = body.input[-1]
    return messages, last.get("role") == "assistant" and last.get("status") in UNFINISHED


def _constraint(body: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format`` as vLLM's ``structured_outputs`` (or the request's own)."""
    form = body.text.format if body.text is not None else None
    if form is None or form.get("type") == "text":
        return body.structured_outputs
    if form.get("type") == "json_object":
        return {"json_object": True}
    if form.get("type") == "json_schema":
        if not isinstance(form.get("name"), str) or not form["name"]:
            raise APIError(400, "text.format.name is required for a json_schema format", param="text")
        if not isinstance(form.get("schema"), dict):
            raise APIError(400, "text.format.schema must be a JSON schema object", param="text")
        return {"json": form["schema"]}
    raise APIError(400, f"text.format type {form.get('type')!r} is not supported", param="text")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion this request asks for (after :func:`refuse_unsupported`)."""
    messages, continued = input_messages(body)
    logprobs = LOGPROBS_INCLUDE in (body.include or [])
    same = (
        "model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty", "logit_bias", "seed", "stop", "stop_token_ids", "ignore_eos",
        "include_stop_str_in_output", "skip_special_tokens", "user", "cache_salt", "chat_template_kwargs", "priority",
    )  # fmt: skip
    fields: dict[str, Any] = {name: getattr(body, name) for name in same}
    fields |= {
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "stream": body.stream,
        "logprobs": logprobs,
        "top_logprobs": body.top_logprobs if logprobs else None,
        "add_generation_prompt": not continued,
        "continue_final_message": continued,
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
        "structured_outputs": _constraint(body),
    }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:  # its fields were checked as the chat route checks them: rare
        problem = error.errors()[0]
        raise APIError(400, f"{'.'.join(map(str, problem['loc']))}: {problem['msg']}") from None
