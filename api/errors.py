"""Errors as vLLM answers them: every failure is ``{"error": {"message", "type", "param", "code"}}``
with ``type`` named after the HTTP status (``BadRequestError``) and ``code`` the status (400)."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from loraserve.adapters import RegistryUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# vLLM's error types (``create_error_response``); other statuses take their HTTP phrase, as
# vLLM's ``GracefulHTTPError`` does ("Too Many Requests").
_TYPES_BY_STATUS = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",  # vLLM's type name for a 501 (this server's: no adapter support)
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error the API reports to the client with ``status_code`` and vLLM's error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status_code, self.param)


def error_type_for(status_code: int) -> str:
    if status_code in _TYPES_BY_STATUS:
        return _TYPES_BY_STATUS[status_code]
    try:
        return HTTPStatus(status_code).phrase
    except ValueError:
        return "InternalServerError" if status_code >= 500 else "BadRequestError"


def error_body(message: str, status_code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's error body: ``type`` named after the status, ``code`` the status itself."""
    return {"error": {"message": message, "type": error_type_for(status_code), "param": param, "code": status_code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def registry_unavailable(error: RegistryUnavailableError) -> APIError:
    """503 for a request that needed the adapter registry while it was unreachable (the message
    names the registry); worth retrying."""
    return APIError(503, str(error), headers={"Retry-After": "1"})


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line per problem, and the first offending field (``messages.0.content``)."""
    parts: list[str] = []
    first_param: str | None = None
    for problem in exc.errors():
        loc = [str(item) for item in problem.get("loc", ()) if item not in ("body", "query", "path", "header")]
        param = ".".join(loc) or None
        first_param = first_param or param
        parts.append(f"{param}: {problem.get('msg')}" if param else str(problem.get("msg")))
    return "; ".join(parts) or "invalid request", first_param


def install_error_handlers(app: FastAPI) -> None:
    """Make FastAPI's own errors (validation, 404 routes, 405), an unreachable adapter registry (503)
    and crashes use the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RegistryUnavailableError)
    async def _registry_unavailable(_: Request, exc: RegistryUnavailableError) -> JSONResponse:
        return error_response(registry_unavailable(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return error_response(APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}"))
