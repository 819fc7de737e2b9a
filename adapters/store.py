"""Where validated adapter files live, by name: the store interface.

:mod:`.local_store` holds the local directory store, :mod:`.redis_store` the shared store for
several replicas; :mod:`.store_factory` builds either from a spec.

Stores hold opaque files; validating their content is :class:`.registry.AdapterRegistry`'s job.
A name maps to a *content key* that names immutable content (fetched with ``get_content``); a
replica follows the name -> key map through a catalog (:mod:`.catalog`, ``open_catalog``) so
that resolving a name needs no I/O.
"""

from __future__ import annotations

import abc
import hashlib
import re
import threading
import weakref
from collections.abc import Hashable, Mapping

from .catalog import AdapterCatalog, PollingCatalog
from .errors import AdapterError, InvalidAdapterNameError

ADAPTER_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# File names inside an adapter: one path component, no leading dot.
FILE_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def validate_adapter_name(name: str) -> str:
    """Return ``name`` if it is a valid adapter name, else raise :class:`InvalidAdapterNameError`."""
    if not isinstance(name, str) or ADAPTER_NAME_PATTERN.fullmatch(name) is None:
        raise InvalidAdapterNameError(
            f"invalid adapter name {name!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, starting with a "
            "letter or digit (no path separators)"
        )
    return name


def validate_file_names(files: Mapping[str, bytes]) -> None:
    """Refuse an empty file set, names that are not one safe path component, and non-bytes contents."""
    if not files:
        raise AdapterError("an adapter needs at least one file")
    for file_name, content in files.items():
        if not isinstance(file_name, str) or FILE_NAME_PATTERN.fullmatch(file_name) is None:
            raise InvalidAdapterNameError(f"invalid adapter file name {file_name!r}")
        if not isinstance(content, bytes | bytearray | memoryview):
            raise TypeError(f"adapter file {file_name!r} must be bytes, got {type(content).__name__}")


def content_digest(files: Mapping[str, bytes]) -> str:
    """sha256 hex of a file set: every (name, length, content) in name order, so equal sets of
    files give equal digests whatever their order, and no two different sets collide by framing."""
    hasher = hashlib.sha256()
    for file_name in sorted(files):
        content = files[file_name]
        hasher.update(file_name.encode() + b"\0" + len(content).to_bytes(8, "big"))
        hasher.update(content)
    return hasher.hexdigest()


_CATALOGS_LOCK = threading.Lock()  # guards every store's set of open catalogs (writes are rare)


class AdapterStore(abc.ABC):
    """Named sets of adapter files. Implementations are safe to use from several processes and threads.

    A reader sees either a complete adapter or none: never a partly written or partly replaced one.
    Each name maps to a content key (``content_key``) naming immutable content: a rewrite with other
    files maps the name to another key, and ``get_content`` of a key returns the same files for as
    long as they are stored. Writes made through a store are passed at once to the catalogs it
    opened (``open_catalog``): subclasses call ``_notify`` after each completed write for that.
    """

    @abc.abstractmethod
    def put(self, name: str, files: Mapping[str, bytes], *, overwrite: bool = False) -> None:
        """Store ``files`` under ``name``; raise :class:`AdapterExistsError` if present and not ``overwrite``."""

    @abc.abstractmethod
    def get(self, name: str) -> dict[str, bytes]:
        """Return the files stored under ``name``; raise :class:`AdapterNotFoundError` if absent."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; raise :class:`AdapterNotFoundError` if absent."""

    @abc.abstractmethod
    def names(self) -> list[str]:
        """Sorted names of all stored adapters."""

    @abc.abstractmethod
    def contains(self, name: str) -> bool:
        """Whether ``name`` is stored."""

    @abc.abstractmethod
    def content_key(self, name: str) -> str:
        """The key of the content ``name`` maps to now (cheap: no file contents read).

        Raises :class:`AdapterNotFoundError` if ``name`` is not stored.
        """

    @abc.abstractmethod
    def get_content(self, key: str) -> dict[str, bytes]:
        """The files stored under content key ``key``, complete; :class:`AdapterNotFoundError` if that
        content is no longer stored (its names were deleted or rewritten)."""

    @abc.abstractmethod
    def index(self) -> dict[str, str]:
        """Every stored name -> its content key."""

    def change_token(self) -> Hashable | None:
        """A cheap value that changes whenever ``index()`` would, or None when the store cannot tell
        (a polling catalog then re-reads the index on every poll)."""
        return None

    def open_catalog(self) -> AdapterCatalog:
        """A started catalog following this store (see :mod:`.catalog`); close it when done.

        This base version polls ``change_token`` and re-reads ``index`` when it moves.
        """
        return self._track(PollingCatalog(self.index, self.change_token, repr(self))).start()

    def _track(self, catalog: AdapterCatalog) -> AdapterCatalog:
        """Pass this store's later writes to ``catalog`` (held weakly)."""
        with _CATALOGS_LOCK:  # created here, not in __init__, so subclasses need not call super().__init__()
            catalogs: weakref.WeakSet[AdapterCatalog] = self.__dict__.setdefault("_catalogs", weakref.WeakSet())
            catalogs.add(catalog)
        return catalog

    def _notify(self, name: str, key: str | None, seq: int | None = None) -> None:
        """Tell this store's catalogs that ``name`` now maps to ``key`` (None: deleted)."""
        with _CATALOGS_LOCK:
            catalogs = list(self.__dict__.get("_catalogs", ()))
        for catalog in catalogs:
            catalog.note(name, key, seq)
