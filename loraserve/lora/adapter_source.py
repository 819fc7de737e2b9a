"""Where one replica's adapters come from: the registry's calls, and its catalog of names.

Two kinds of access, kept apart on purpose:

* Calls that wait on the registry (register, remove, info, reading files): on API worker threads
  or the adapter loader thread, never the engine thread. Every failure is an ``AdapterError``
  (``RegistryUnavailableError`` when the registry cannot be reached).
* Name lookups (``lookup``, ``up``): the catalog's in-memory map (``adapters/catalog.py``), no I/O,
  safe on the engine thread on every request. A change made through this replica's store is in
  the map before the call returns; another replica's as soon as its message (Redis) or the
  directory poll arrives.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from loraserve.adapters import (
    AdapterError,
    AdapterInfo,
    AdapterNotFoundError,
    AdapterRegistry,
    RegistryUnavailableError,
)

logger = logging.getLogger(__name__)

CATALOG_READY_S = 5.0  # at construction, how long to wait for the catalog's first sync


class AdapterSource:
    """The registry plus a started catalog following its store; :meth:`close` stops the catalog."""

    def __init__(self, registry: AdapterRegistry, ready_timeout_s: float = CATALOG_READY_S) -> None:
        self.registry = registry
        self.catalog = registry.store.open_catalog()
        if not self.catalog.wait_ready(ready_timeout_s):
            logger.warning("adapter registry %s has not answered yet; continuing", self.catalog.description)
        # name -> (content key, its info, or why it does not parse: asked again only for new content)
        self._infos: dict[str, tuple[str, AdapterInfo | AdapterError]] = {}

    def close(self) -> None:
        self.catalog.close()

    # ---- the catalog (any thread, no I/O) ---------------------------------------------
    def lookup(self, name: str) -> str | None:
        """The content key ``name`` maps to, None if it is not registered (as last seen)."""
        return self.catalog.lookup(name)

    @property
    def up(self) -> bool:
        """Whether the registry answers and its changes are followed (the catalog is current)."""
        return self.catalog.up

    @property
    def num_registered(self) -> int:
        return self.catalog.num_names

    def unavailable_error(self, what: str) -> RegistryUnavailableError:
        """The error for a request that needs the registry while it is unreachable."""
        catalog = self.catalog
        return RegistryUnavailableError(
            f"{what}: the adapter registry {catalog.description} is unavailable ({catalog.last_error}); retry later"
        )

    # ---- registry calls (never on the engine thread) ---------------------------------------
    def register(self, name: str, files: Mapping[str, bytes], overwrite: bool = False) -> AdapterInfo:
        return self.registry.register(name, files, overwrite=overwrite)  # the store tells the catalog

    def register_from_path(self, name: str, path: str, overwrite: bool = False) -> AdapterInfo:
        return self.registry.register_from_path(name, path, overwrite=overwrite)

    def remove(self, name: str) -> None:
        self.registry.delete(name)
        self._infos.pop(name, None)

    def info(self, name: str) -> AdapterInfo:
        """Summary of ``name``, parsed once per stored content (as is the ``AdapterError`` of
        content that does not parse, logged once)."""
        key = self.registry.store.content_key(name)
        cached = self._infos.get(name)
        if cached is None or cached[0] != key:
            key, files = self.read(name, key)
            try:
                cached = (key, AdapterInfo.from_adapter(self.registry.parse(name, files)))
            except AdapterError as error:
                logger.warning("stored adapter %r cannot be served: %s", name, error)
                cached = (key, error)
            self._infos[name] = cached
        if isinstance(cached[1], AdapterError):
            raise cached[1]
        return cached[1]

    def read(self, name: str, key: str) -> tuple[str, Mapping[str, bytes]]:
        """The files of ``name`` and the content key they were read under: ``key``'s, or whatever
        the name holds now if that content is gone (deleted or rewritten after the catalog saw it).

        Every failure is an ``AdapterError``, so a store's own exception type never escapes the
        engine loop through the scheduler (which ends only the adapter's requests on those).
        """
        store = self.registry.store
        try:
            try:
                return key, store.get_content(key)
            except AdapterNotFoundError:
                current = store.content_key(name)
                return current, store.get_content(current)
        except AdapterError:
            raise
        except Exception as error:  # OSError, a client library's error
            raise AdapterError(
                f"reading adapter {name!r} from {store!r} failed: {type(error).__name__}: {error}"
            ) from error
