"""An Anthropic Messages request as the chat completion it asks for, as vLLM 0.32 reads it for a
chat model without tool or reasoning parsers: ``system`` a leading system message (its text
blocks joined with nothing between them, vLLM's), each message's text blocks joined by newlines
(the chat template's join), ``stop_sequences`` the stop strings, ``output_config.format`` a JSON
schema, ``output_config.effort`` and ``thinking: disabled`` the template's reasoning effort;
system messages among the turns kept in place, or merged into the leading one for a template that
refuses them (vLLM's probe).

One rule differs from vLLM's, to keep Anthropic's meaning: a conversation that ends with an
assistant message is that message's continuation (Anthropic's prefill), not a new turn after it.
Thinking blocks of earlier turns are left out (the model's template does not see them, as
Anthropic's API drops them). Tools, tool blocks, images and ``thinking`` of type ``enabled`` (a
budget) or with a ``display`` are refused by name: there is no tool-call or reasoning parser."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .anthropic_protocol import ContentBlock, CountTokensRequest, MessagesRequest
from .errors import APIError
from .openai_protocol import ChatCompletionRequest, ChatMessage

BILLING_HEADER = "x-anthropic-billing-header"  # system blocks Claude Code sends; vLLM drops them
DROPPED = ("thinking", "redacted_thinking")  # earlier turns' reasoning, not shown to the template


def refuse_unsupported(body: MessagesRequest | CountTokensRequest) -> None:
    """400 naming what loraserve does not serve here."""
    refused = [name for name in getattr(body, "REFUSED", ()) if getattr(body, name) not in (None, False, {}, [])]
    if refused:
        raise APIError(400, f"unsupported parameter(s) {refused}: loraserve does not implement them", param=refused[0])
    if body.tools:
        raise APIError(400, "tools are not supported: loraserve has no tool-call parser", param="tools")
    if body.tool_choice is not None and body.tool_choice.type != "none":
        message = f"tool_choice '{body.tool_choice.type}' needs tools, which are not supported"
        raise APIError(400, message, param="tool_choice")
    if body.thinking is not None and body.thinking.type == "enabled":
        message = "thinking 'enabled' is not supported: loraserve has no reasoning parser or thinking budget"
        raise APIError(400, message, param="thinking")
    if body.thinking is not None and body.thinking.display is not None:
        message = "thinking.display is not supported: loraserve has no reasoning parser to set thinking apart"
        raise APIError(400, message, param="thinking")


def _text(content: str | list[ContentBlock], where: str, separator: str = "\n") -> str:
    """A message's (or ``system``'s) text blocks joined; any other block refused by name."""
    if isinstance(content, str):
        return content
    texts = []
    for index, block in enumerate(content):
        if block.type in DROPPED:
            continue
        if block.type != "text":
            place = f"{where}.{index}"
            raise APIError(400, f"{place}: content blocks of type '{block.type}' are not supported", param=place)
        if block.text and not block.text.startswith(BILLING_HEADER):  # empty text skipped, as vLLM's
            texts.append(block.text)
    return separator.join(texts)


def chat_messages(
    body: MessagesRequest | CountTokensRequest, merge_inline_system: bool
) -> tuple[list[ChatMessage], bool]:
    """The chat messages, and whether the last one (an assistant message) is continued. A system
    message among ``messages`` (vLLM takes them) keeps its place with its text blocks joined with
    nothing between them, or is left out when it has no text; with ``merge_inline_system`` (a
    template that refuses them) its text is appended to the leading system message instead."""
    if not body.messages:
        raise APIError(400, "messages must hold at least one message", param="messages")
    system = [_text(body.system, "system", separator="")] if body.system is not None else []
    turns = []
    for index, message in enumerate(body.messages):
        where = f"messages.{index}.content"
        if message.role != "system":
            turns.append(ChatMessage(role=message.role, content=_text(message.content, where)))
            continue
        text = _text(message.content, where, separator="")
        if text.startswith(BILLING_HEADER):  # a string's too (vLLM's): its per-request hash defeats the prefix cache
            text = ""
        if merge_inline_system:
            system.append(text)
        elif text:
            turns.append(ChatMessage(role="system", content=text))
    leading = "".join(system)
    messages = [ChatMessage(role="system", content=leading)] if leading else []
    return messages + turns, body.messages[-1].role == "assistant"


def _constraint(body: MessagesRequest | CountTokensRequest) -> dict[str, Any] | None:
    form = body.output_config.format if body.output_config is not None else None
    if form is None:
        return None
    if not isinstance(form.json_schema, dict):
        raise APIError(400, "output_config.format.schema must be a JSON schema object", param="output_config")
    return {"json": form.json_schema}


def _effort(body: MessagesRequest | CountTokensRequest) -> str | None:
    if body.thinking is not None and body.thinking.type == "disabled":
        return "none"  # vLLM's choice for a template that takes an effort
    return body.output_config.effort if body.output_config is not None else None


def chat_request(body: MessagesRequest | CountTokensRequest, merge_inline_system: bool) -> ChatCompletionRequest:
    """The chat completion this request asks for (after :func:`refuse_unsupported`)."""
    messages, continued = chat_messages(body, merge_inline_system)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "add_generation_prompt": not continued,
        "continue_final_message": continued,
        "reasoning_effort": _effort(body),
        "chat_template_kwargs": body.chat_template_kwargs,
        "structured_outputs": _constraint(body),
    }
    if isinstance(body, MessagesRequest):
        fields |= {
            "max_completion_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stream": bool(body.stream),
            "cache_salt": body.cache_salt,
        }
    try:
        return ChatCompletionRequest.model_validate(
            {name: value for name, value in fields.items() if value is not None}
        )
    except ValidationError as error:  # a sampling field out of the chat route's range
        problem = error.errors()[0]
        field = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences"}.get(str(problem["loc"][0]))
        param = field or ".".join(map(str, problem["loc"]))
        raise APIError(400, f"{param}: {problem['msg']}", param=param) from None
