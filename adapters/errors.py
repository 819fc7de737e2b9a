"""Exception hierarchy for adapter parsing, uploads and stores.

Every error is an :class:`AdapterError` (a ``ValueError``) so callers can catch one class; the
subclasses let an HTTP layer pick a status code (check subclasses before the base class):

* :class:`AdapterTooLargeError` -> 413
* :class:`AdapterNotFoundError` -> 404
* :class:`InvalidAdapterError` -> 400 (its files do not parse or do not fit this server)
* :class:`AdapterExistsError` and :class:`RegistryConflictError` -> 409
* :class:`RegistryUnavailableError` -> 503 (the registry, not the adapter, is the problem)
* :class:`InvalidAdapterNameError` and plain :class:`AdapterError` -> 400 / 422
"""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter (or its upload, or its name) is invalid; the message names the problem and where.

    ``code`` classifies the failure of a request whose adapter could not be loaded
    (``RequestOutput.error_code``); None where the server, not the adapter, is at fault.
    """

    code: str | None = None


class InvalidAdapterError(AdapterError):
    """The adapter's files do not parse, or do not fit this server (the base model's shapes, its
    ``max_lora_rank``): at registration, or when a stored adapter is loaded for a request."""

    code = "invalid_adapter"


class AdapterTooLargeError(AdapterError):
    """An upload exceeds a size or member-count limit."""


class InvalidAdapterNameError(AdapterError):
    """An adapter or file name does not satisfy the store's naming rules."""


class AdapterExistsError(AdapterError):
    """An adapter with this name is already stored and overwrite was not requested."""


class RegistryConflictError(AdapterError):
    """The registry cannot take the adapter as it stands (not the adapter's fault): it holds its
    ``max_adapters`` limit, or an entry it did not make takes the name in its directory."""


class AdapterNotFoundError(AdapterError):
    """No adapter with this name is stored."""

    code = "adapter_not_found"


class RegistryUnavailableError(AdapterError):
    """The adapter registry (its store: Redis, a shared directory) cannot be reached right now.

    Not the client's fault and worth retrying: HTTP layers answer 503 (check it before the
    :class:`AdapterError` base class). It is an :class:`AdapterError` so that code failing the
    requests of one adapter on a bad load (the scheduler) treats it the same way: only the
    requests that needed the registry fail. The message names the registry.
    """

    code = "registry_unavailable"
