"""Chat messages through the base model's chat template: the prompt's token ids, and the text of
a message as the template sees it (content parts joined, roles and tool calls as vLLM hands them
over)."""

from __future__ import annotations

import inspect
import json
import logging
from typing import Any

from jinja2.exceptions import TemplateError

from .errors import APIError
from .openai_protocol import ChatMessage, ToolCall
from .serving import ServerState

logger = logging.getLogger(__name__)


def message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    """``messages[index]`` as the chat template reads it (its text parts joined by newlines, a
    developer message as a system one); a 400 naming the field for what cannot be rendered."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise APIError(
                    400,
                    f"messages[{index}]: only text content parts are supported, got {part.type!r}",
                    param=f"messages.{index}.content",
                )
            texts.append(part.text)
        content = "\n".join(texts)
    role = "system" if message.role == "developer" else message.role
    rendered: dict[str, Any] = {"role": role, "content": content or ""}
    if message.name is not None:  # the template's to use (as vLLM hands it over)
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        if message.role != "tool":
            where = f"messages.{index}.tool_call_id"
            raise APIError(400, f"messages[{index}]: only tool messages have a tool_call_id", param=where)
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        if message.role != "assistant":
            where = f"messages.{index}.tool_calls"
            raise APIError(400, f"messages[{index}]: only assistant messages have tool_calls", param=where)
        rendered["tool_calls"] = [_tool_call_dict(call, index, j) for j, call in enumerate(message.tool_calls)]
    return rendered


def _tool_call_dict(call: ToolCall, index: int, number: int) -> dict[str, Any]:
    """A history tool call as templates read it: the arguments as an object (JSON text parsed, as
    vLLM does; absent or empty: ``{}``)."""
    where = f"messages.{index}.tool_calls.{number}.function.arguments"
    arguments: Any = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as error:  # bad JSON, too many digits, too deep
            raise APIError(400, f"{where} is not JSON: {error}", param=where) from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where} is not a JSON object", param=where)
    rendered: dict[str, Any] = {"type": call.type, "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        rendered["id"] = call.id
    return rendered


async def render_chat_prompt(
    state: ServerState,
    chat: list[ChatMessage],
    add_generation_prompt: bool,
    add_special_tokens: bool = False,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """``render_chat_text``'s text, tokenized (a long one off the event loop: ``PromptEncoder``)."""
    text = render_chat_text(state, chat, add_generation_prompt, continue_final_message, template_kwargs)
    return await state.prompts.encode(text, add_special_tokens)


def render_chat_text(
    state: ServerState,
    chat: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Apply the base model's chat template (the API's tokenizer's). ``template_kwargs``: extra
    variables of the template (vLLM's ``chat_template_kwargs``)."""
    messages = [message_dict(message, i) for i, message in enumerate(chat)]
    if getattr(state.tokenizer, "chat_template", None) is None:
        raise APIError(400, "the base model has no chat template; use /v1/completions", param="messages")
    if continue_final_message and add_generation_prompt:
        raise APIError(
            400, "continue_final_message and add_generation_prompt cannot both be true", param="continue_final_message"
        )
    if template_kwargs:  # template variables only: not the call's own options (a template, tools, ...)
        options = set(inspect.signature(state.tokenizer.apply_chat_template).parameters) - {"kwargs"}
        taken = sorted(options.intersection(template_kwargs))
        if taken:
            raise APIError(400, f"chat_template_kwargs may not set {taken}", param="chat_template_kwargs")
    variables = {
        **(template_kwargs or {}),
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "tokenize": False,
    }
    try:
        text = state.tokenizer.apply_chat_template(messages, **variables)
    except Exception as error:  # jinja raises for conversations the template refuses
        raise APIError(400, f"the chat template refused the messages: {error}", param="messages") from None
    return str(text)


INLINE_SYSTEM_PROBE = [{"role": "system", "content": "t"}, {"role": "user", "content": "t"}] * 2


def refuses_inline_system(tokenizer: Any) -> bool:
    """Whether the chat template refuses a system message after the first turn (vLLM's probe: it
    renders system, user, system, user); a tokenizer without a template counts as refusing. The
    probe renders as a request does (``bos_token``, ``raise_exception`` defined), so a template
    that needs those is judged by its messages' order, not by a missing variable as in vLLM's."""
    if getattr(tokenizer, "chat_template", None) is None:
        return True
    try:
        tokenizer.apply_chat_template(INLINE_SYSTEM_PROBE, tokenize=False, add_generation_prompt=False)
    except TemplateError:  # a template's raise_exception (e.g. "System message must be at the beginning")
        return True
    except Exception:  # any other failure: merging is the safe reading, and the server must still start
        logger.warning("the chat template failed on the inline-system probe; inline system messages will be merged")
        return True
    return False
