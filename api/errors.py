"""OpenAI-shaped errors: every failure answers ``{"error": {"message", "type", "param", "code"}}``."""

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

_TYPES_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the API reports to the client with ``status_code`` and the OpenAI error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or error_type_for(status_code)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_type_for(status_code: int) -> str:
    if status_code >= 500:
        return "server_error"
    return _TYPES_BY_STATUS.get(status_code, "invalid_request_error")


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def registry_unavailable(error: RegistryUnavailableError) -> APIError:
    """503 for a request that needed the adapter registry while it was unreachable (the message
    names the registry); worth retrying."""
    return APIError(503, str(error), code=RegistryUnavailableError.code, headers={"Retry-After": "1"})


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
        return error_response(APIError(400, message, param=param, code="invalid_value"))

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
