"""Exception hierarchy for adapter parsing, uploads and stores.

Every error is an :class:`AdapterError` (a ``ValueError``) so callers can catch one class; the
subclasses let an HTTP layer pick a status code (check subclasses before the base class):

* :class:`AdapterTooLargeError` -> 413
* :class:`AdapterNotFoundError` -> 404
* :class:`AdapterExistsError` -> 409
* :class:`InvalidAdapterNameError` and plain :class:`AdapterError` -> 400 / 422
"""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter (or its upload, or its name) is invalid; the message names the problem and where."""


class AdapterTooLargeError(AdapterError):
    """An upload exceeds a size or member-count limit."""


class InvalidAdapterNameError(AdapterError):
    """An adapter or file name does not satisfy the store's naming rules."""


class AdapterExistsError(AdapterError):
    """An adapter with this name is already stored and overwrite was not requested."""


class AdapterNotFoundError(AdapterError):
    """No adapter with this name is stored."""
