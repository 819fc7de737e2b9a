"""A request's structured output as vLLM 0.32 reads it: ``structured_outputs`` (``json``,
``json_object``, ``regex``, ``choice``, ``grammar``, ``disable_any_whitespace``), with OpenAI's
``response_format`` (``json_object``, ``json_schema``) taking the place of its constraint.
Compiled here, off the event loop, so a bad schema, regex or grammar is a 400 naming the field
before the request reaches the engine (which finds the compiled grammar in the compiler's cache)."""

from __future__ import annotations

import asyncio
from typing import Any

from loraserve.structured_outputs import ConstraintKind, StructuredOutputsError, StructuredOutputsParams

from .errors import APIError
from .openai_protocol import _SamplingFields
from .serving import ServerState

OPTIONS = ("disable_any_whitespace",)
# vLLM's options that loraserve does not implement: refused when set
REFUSED = ("structural_tag", "whitespace_pattern", "disable_additional_properties", "disable_fallback")


def _constraint_fields(request: _SamplingFields) -> tuple[dict[str, Any], str]:
    """The ``StructuredOutputsParams`` fields and the request field they came from."""
    fields = dict(request.structured_outputs or {})
    for name in fields:
        if name in REFUSED and fields[name] not in (None, False):
            raise APIError(400, f"structured_outputs.{name} is not supported", param="structured_outputs")
        if name not in REFUSED and name not in OPTIONS and name not in {kind.value for kind in ConstraintKind}:
            raise APIError(400, f"structured_outputs has no field {name!r}", param="structured_outputs")
    fields = {name: value for name, value in fields.items() if name not in REFUSED}
    response_format = request.response_format or {}
    kind = response_format.get("type", "text")
    if kind in (None, "text"):
        return fields, "structured_outputs"
    if kind == "json_object":
        return {**fields, "json_object": True}, "response_format"
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        if not isinstance(json_schema, dict):
            raise APIError(
                400, "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                param="response_format",
            )  # fmt: skip
        schema = json_schema.get("schema")
        if not isinstance(schema, dict):
            raise APIError(
                400, "response_format.json_schema.schema must be a JSON schema object", param="response_format"
            )
        return {**fields, "json": schema}, "response_format"
    raise APIError(400, f"response_format type {kind!r} is not supported", param="response_format")


async def structured_outputs_of(state: ServerState, request: _SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint, compiled once to check it (None without one)."""
    fields, source = _constraint_fields(request)
    if not any(value not in (None, False) for name, value in fields.items() if name not in OPTIONS):
        return None
    try:
        params = StructuredOutputsParams(**fields)
        await asyncio.to_thread(state.engine.grammars.compile, params)  # a thread-safe compiler
    except (StructuredOutputsError, TypeError) as error:
        message = str(error)
        if source == "response_format":  # named as the client sent it
            message = message.replace("structured_outputs.json:", "response_format.json_schema.schema:")
        raise APIError(400, message, param=source) from None
    return params
