"""Bearer-key checks: the API key guards inference and reads, the admin key guards adapter changes.

Rules (see :class:`~loraserve.api.settings.ServerSettings`): with ``api_key`` set, inference
and read endpoints need it (or the admin key); adapter-changing endpoints need
``settings.adapter_key`` (the admin key, else the API key); with neither key set everything is
open. ``/health``, ``/metrics`` and the docs are always open. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import APIError
from .settings import ServerSettings

_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <key>`")
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def _same(presented: str, expected: str) -> bool:
    return hmac.compare_digest(presented.encode(), expected.encode())


def _settings(request: Request) -> ServerSettings:
    settings: ServerSettings = request.app.state.settings
    return settings


def _presented_key(credentials: HTTPAuthorizationCredentials | None) -> str:
    if credentials is None or not credentials.credentials:
        raise APIError(
            401,
            "missing API key: send the header 'Authorization: Bearer <key>'",
            headers=_CHALLENGE,
        )
    return credentials.credentials


def _check_api_key(request: Request, settings: ServerSettings, key: str) -> None:
    """Accept the server's API key or admin key, and note which (``request.state.key_bucket``, the
    in-flight limiter's bucket, so a key counts as itself whichever header brought it)."""
    assert settings.api_key is not None
    if _same(key, settings.api_key):
        request.state.key_bucket = "api"
    elif settings.admin_key is not None and _same(key, settings.admin_key):
        request.state.key_bucket = "admin"
    else:
        raise APIError(401, "invalid API key", headers=_CHALLENGE)


def require_api_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """Dependency of inference and read endpoints."""
    settings = _settings(request)
    if settings.api_key is not None:
        _check_api_key(request, settings, _presented_key(credentials))


def require_api_key_or_x_api_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """Dependency of Anthropic's routes: the key as a bearer token, or in the ``x-api-key`` header
    that Anthropic's clients send."""
    settings = _settings(request)
    key = request.headers.get("x-api-key")
    if settings.api_key is None:
        return
    if credentials is None and not key:
        raise APIError(
            401,
            "missing API key: send the header 'x-api-key: <key>' or 'Authorization: Bearer <key>'",
            headers=_CHALLENGE,
        )
    _check_api_key(request, settings, key if credentials is None and key else _presented_key(credentials))


def require_admin_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """Dependency of every adapter-changing endpoint."""
    settings = _settings(request)
    required = settings.adapter_key
    if required is None:
        return
    key = _presented_key(credentials)
    if _same(key, required):
        return
    if settings.admin_key is not None and settings.api_key is not None and _same(key, settings.api_key):
        raise APIError(403, "changing adapters needs the admin key, not the API key")
    raise APIError(401, "invalid API key", headers=_CHALLENGE)
