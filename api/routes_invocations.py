"""``POST /invocations``: SageMaker's inference route, as vLLM 0.32 serves it. The body is a chat
completion request when it reads as one (it has ``messages``), else a completion request (it has
``prompt``), answered by that route; the header ``X-Amzn-SageMaker-Adapter-Identifier``, where
sent, names the model (an adapter) in place of the body's ``model``. ``/ping``, the route's
health check, is in ``routes_models``."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic
from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError

from .auth import require_api_key
from .errors import APIError
from .openai_protocol import ChatCompletionRequest, CompletionRequest
from .routes_chat import create_chat_completion
from .routes_completions import ERROR_RESPONSES, create_completion
from .serving import require_json

router = APIRouter(tags=["inference"])

ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"  # SageMaker's (model_hosting_container_standards)

Endpoint = Callable[[Any, Request], Awaitable[Any]]
# In vLLM's order: the first request type the body validates as answers it.
_REQUEST_TYPES: tuple[tuple[type[pydantic.BaseModel], str, Endpoint], ...] = (
    (ChatCompletionRequest, "messages", create_chat_completion),
    (CompletionRequest, "prompt", create_completion),
)


@router.post(
    "/invocations",
    responses={200: {"content": {"text/event-stream": {}}}, **ERROR_RESPONSES},
    dependencies=[Depends(require_api_key), Depends(require_json)],
    summary="SageMaker's inference route: a chat completion or completion request, told apart by its fields",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "anyOf": [
                            {"$ref": f"#/components/schemas/{request_type.__name__}"}
                            for request_type, _, _ in _REQUEST_TYPES
                        ]
                    }
                }
            },
        }
    },
)
async def invocations(request: Request) -> Any:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"JSON decode error: {error}") from None
    except RecursionError:
        raise APIError(400, "JSON decode error: the body is nested too deeply") from None
    if isinstance(body, dict) and request.headers.get(ADAPTER_HEADER):
        body = {**body, "model": request.headers[ADAPTER_HEADER]}
    for request_type, key_field, endpoint in _REQUEST_TYPES:
        try:
            parsed = request_type.model_validate(body)
        except pydantic.ValidationError as error:
            if isinstance(body, dict) and key_field in body:  # meant as this type: its own problems
                raise RequestValidationError(error.errors()) from None
            continue
        return await endpoint(parsed, request)
    names = [request_type.__name__ for request_type, _, _ in _REQUEST_TYPES]
    raise APIError(400, f"Cannot find suitable handler for request. Expected one of: {names}")
