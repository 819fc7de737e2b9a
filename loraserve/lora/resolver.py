"""Adapter names to content digests: the registry tier of adapter residency (``residency.py``).

* A request names an adapter; it is resolved once, at arrival, to the adapter's content
  digest, and everything after that (residency, prefix-cache keys) uses the digest.
* Reading an adapter that is not in host memory from the store runs on a background thread
  (``resolve_nowait``), so the engine keeps stepping while the files arrive (S-LoRA's
  asynchronous adapter loading); the engine holds the request back until then. Parsing (the
  safetensors copy, the finiteness check, the content digest) runs there too when
  ``parse_in_background``: where the forward leaves host cores idle (a GPU engine, or a CPU engine
  with fewer torch threads than cores). Otherwise it stays on the engine's thread: torch ops on a
  second thread start a second OpenMP team, which on a machine whose cores the engine already
  fills slowed the steps by a quarter.
* No registry call runs on the engine thread. Names resolve through the store's catalog
  (``adapters/catalog.py``): an in-memory name -> content key map that a background thread keeps
  current (Redis: pub/sub), so a delete or re-registration anywhere reaches every replica
  without a round trip per request (a directory store's lookup reads the name's link: one
  system call, as before). Content keys name immutable content, so the key -> digest map of the
  host tier never goes stale; requests already running keep the digest they resolved. With the
  registry unreachable, adapters in host memory (and so in the pool) keep being served; a request
  that needs the store fails with ``RegistryUnavailableError`` (HTTP 503).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from loraserve.adapters import (
    AdapterError,
    AdapterInfo,
    AdapterNotFoundError,
    AdapterRegistry,
    LoRAAdapter,
    RegistryUnavailableError,
)
from loraserve.lora.adapter_source import AdapterSource
from loraserve.lora.host_tier import HostTier


@dataclass(frozen=True)
class _Read:
    """A read of an adapter's files in flight on the loader thread; the future gives the content
    key actually read (the name may have moved on meanwhile) and the files."""

    key: str
    future: Future[tuple[str, Mapping[str, bytes] | LoRAAdapter]]  # files, or parsed in the background


@dataclass(frozen=True)
class _Failure:
    """A read or parse of a name's content that failed: every request waiting for that content
    gets this error, rather than each starting a read of its own, until the name moves to other
    content or ``FAILURE_MEMORY_S`` pass (a store's error may be transient)."""

    key: str
    error: AdapterError
    at: float  # time.monotonic()


FAILURE_MEMORY_S = 10.0


class AdapterResolver:
    """``resolve`` and ``resolve_nowait`` run on the engine thread only; the name methods
    (``register``, ``remove``, ``info``) wait on the registry and run on worker threads."""

    def __init__(self, registry: AdapterRegistry, host: HostTier, parse_in_background: bool = False) -> None:
        """Parsed adapters go into ``host`` (the adapter manager's host-memory tier), where later
        resolves of the same content find them. ``parse_in_background``: see the module's docstring."""
        self.registry = registry
        self.host = host
        self.parse_in_background = parse_in_background
        self.source = AdapterSource(registry)  # its catalog thread starts now; close() stops it
        self._loads: dict[str, _Read] = {}  # name -> the read of its files in flight on the loader thread
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraserve-adapter-load")
        self._unavailable: set[str] = set()  # names whose last resolve failed for want of the registry
        self._failed: dict[str, _Failure] = {}  # name -> its content's failed read or parse

    # ---- names (any thread but the engine's: these wait on the registry) ----------------
    def register(self, name: str, files: Mapping[str, bytes], overwrite: bool = False) -> AdapterInfo:
        return self.source.register(name, files, overwrite=overwrite)

    def register_from_path(self, name: str, path: str, overwrite: bool = False) -> AdapterInfo:
        return self.source.register_from_path(name, path, overwrite=overwrite)

    def remove(self, name: str) -> None:
        """Unregister; requests already holding the adapter's digest keep running on it."""
        self.source.remove(name)

    def info(self, name: str) -> AdapterInfo:
        """Summary of ``name``, parsed once per stored content."""
        return self.source.info(name)

    @property
    def registry_up(self) -> bool:
        """Whether the registry answers and this replica follows its changes (the catalog is current)."""
        return self.source.up

    @property
    def num_registered(self) -> int:
        """Registered adapters as this replica last saw them (no I/O)."""
        return self.source.num_registered

    def error_code(self, name: str | None) -> str | None:
        """``RegistryUnavailableError.code`` if the last resolve of ``name`` failed for want of the
        registry (how the engine tells a client to retry later), else None."""
        return RegistryUnavailableError.code if name in self._unavailable else None

    def close(self) -> None:
        """Stop following the registry and the loader thread (reads in flight are dropped)."""
        self.source.close()
        self._loader.shutdown(wait=False, cancel_futures=True)

    # ---- resolving (the engine thread) ------------------------------------------------
    def resolve(self, name: str) -> str:
        """The content digest of the adapter registered as ``name`` (loaded into host memory)."""
        adapter_id = self.resolve_nowait(name)
        while adapter_id is None:
            self.wait_for_load(name)
            adapter_id = self.resolve_nowait(name)
        return adapter_id

    def resolve_nowait(self, name: str) -> str | None:
        """Like :meth:`resolve`, but None while the adapter's files are being read.

        No I/O: the name goes through the catalog; the first call for an adapter not in host memory
        starts reading its files on the loader thread; a later call after the read finished parses
        them and takes the adapter in. Raises ``AdapterNotFoundError`` at once for a name that is
        not registered, ``RegistryUnavailableError`` at once when the adapter is not in host memory
        and the registry is unreachable, and the read's or the parse's error (an ``AdapterError``)
        if either failed.
        """
        read = self._loads.get(name)
        if read is not None and not read.future.done():
            return None  # polled every step while loading
        self._unavailable.discard(name)
        try:
            return self._resolve(name, read)
        except RegistryUnavailableError:
            self._unavailable.add(name)
            raise

    def _resolve(self, name: str, read: _Read | None) -> str | None:
        key = self.source.lookup(name)
        if read is not None:
            del self._loads[name]
            if key == read.key:
                if read.future.cancelled():  # close() dropped it
                    raise AdapterError(f"reading adapter {name!r} was cancelled: the adapter manager is closed")
                try:
                    return self._take_in(name, *read.future.result())  # raises the read's error
                except RegistryUnavailableError:
                    raise  # the registry's state, not the content's: the next resolve asks again
                except AdapterError as error:
                    self._failed[name] = _Failure(key, error, time.monotonic())
                    raise
            # Otherwise the name moved on (deleted or re-registered) while its files were read.
        failure = self._failed.pop(name, None)
        if failure is not None and failure.key == key and time.monotonic() - failure.at < FAILURE_MEMORY_S:
            self._failed[name] = failure
            raise failure.error
        if key is None:
            if not self.source.up:
                raise self.source.unavailable_error(f"adapter {name!r} cannot be looked up")
            raise AdapterNotFoundError(f"adapter {name!r} not found")
        digest = self.host.digest_of_key(key)
        if digest is not None:
            return digest
        if not self.source.up:
            raise self.source.unavailable_error(f"adapter {name!r} is not loaded on this replica")
        work = self._read_and_parse if self.parse_in_background else self.source.read
        self._loads[name] = _Read(key, self._loader.submit(work, name, key))
        return None

    def _read_and_parse(self, name: str, key: str) -> tuple[str, LoRAAdapter]:
        """The loader thread's work when parsing in the background."""
        key, files = self.source.read(name, key)
        return key, self.registry.parse(name, files)

    def _take_in(self, name: str, key: str, read: Mapping[str, bytes] | LoRAAdapter) -> str:
        adapter = read if isinstance(read, LoRAAdapter) else self.registry.parse(name, read)
        self.host.put(key, adapter)
        return adapter.digest

    def drop_read(self, name: str) -> None:
        """Forget the read of ``name`` (no request waits for it any more: all were aborted): it is
        cancelled if it has not started, and its files (or parsed weights), which nothing counts
        against the host cache, are not kept until the name is asked for again."""
        read = self._loads.pop(name, None)
        if read is not None:
            read.future.cancel()

    def wait_for_load(self, name: str, timeout: float | None = None) -> None:
        """Block until the read of ``name`` in flight (if any) is done, or ``timeout`` seconds."""
        read = self._loads.get(name)
        if read is not None:
            wait([read.future], timeout=timeout)
