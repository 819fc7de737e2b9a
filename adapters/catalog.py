"""A replica's in-memory copy of the registry's name -> content key map, kept current in the background.

Why: the engine resolves an adapter name on every request, on its own thread, and must never
wait on the registry there (a Redis round trip per request; a hang or an error while Redis is
down). So each replica keeps the map in memory (lookups are dictionary reads, no I/O) and one
background thread keeps it current: :class:`~.redis_catalog.RedisCatalog` from a snapshot plus
the store's pub/sub changes, :class:`PollingCatalog` (the local directory store, and any store
without push) by re-reading the store's index whenever its cheap change token moves. (The
directory store's lookups read the name's link instead, one system call: see ``probe``.)

Content keys name immutable content (Redis: the content digest; a directory: the version
directory), so whatever a replica derived from a key (parsed weights) never goes stale; only the
name -> key map has to be current. A change made through this process's store (:meth:`note`) is
visible at once; another process's change as soon as the thread sees it.

While the registry is unreachable the catalog keeps its last map, reports ``up = False`` and its
thread retries with bounded exponential backoff (with jitter, so replicas do not reconnect in
lockstep), logging once when an outage starts and once when it ends.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import weakref
from collections.abc import Callable, Hashable

logger = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0  # the longest a replica waits between reconnection attempts


class AdapterCatalog:
    """Name -> content key, readable from any thread without I/O; see the module docstring.

    Subclasses implement :meth:`_tick` (one bounded unit of work on the catalog thread) and, if
    they hold a connection, :meth:`_disconnect`. :meth:`start` launches the thread; it holds only
    a weak reference, so a catalog nobody references any more stops by itself. :meth:`close`
    stops it at once.
    """

    def __init__(self, description: str) -> None:
        self.description = description  # names the registry in logs and errors (no secrets)
        self._lock = threading.Lock()  # serialises writers; readers take the current dict unlocked
        self._keys: dict[str, str] = {}  # replaced, never changed in place, so readers need no lock
        self._up = False
        self._last_error = "not connected yet"
        self._down_since: float | None = None
        self._ready = threading.Event()  # the first attempt to sync finished, successfully or not
        self._stop = threading.Event()
        self._backoff_s = BACKOFF_MIN_S
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description}, up={self._up}, {len(self._keys)} names)"

    # ---- lifecycle ------------------------------------------------------------------
    def start(self) -> AdapterCatalog:
        """Start the background thread (once); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=_run, args=(weakref.ref(self), self._stop), name="loraserve-adapter-catalog", daemon=True
            )
            self._thread.start()
        return self

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the first sync attempt finished (at most ``timeout`` s); True if it did."""
        return self._ready.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and drop the connection; the last map stays readable."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("adapter catalog thread for %s did not stop within %.0f s", self.description, timeout)
                return  # it still uses the connection; it ends at its next tick
        self._disconnect()

    # ---- reads (any thread, no I/O) ---------------------------------------------------
    def lookup(self, name: str) -> str | None:
        """The content key ``name`` maps to, or None if it is not registered (as last seen)."""
        return self._keys.get(name)

    def names(self) -> list[str]:
        """Sorted registered names (as last seen)."""
        return sorted(self._keys)

    @property
    def num_names(self) -> int:
        return len(self._keys)

    @property
    def up(self) -> bool:
        """True while the map is current: the registry answered and changes are being followed."""
        return self._up

    @property
    def last_error(self) -> str:
        """Why the registry was last unreachable (for error messages)."""
        return self._last_error

    # ---- writes ---------------------------------------------------------------------
    def note(self, name: str, key: str | None, seq: int | None = None) -> None:
        """A change this process just made (``key`` None: deleted), visible here at once.

        ``seq`` orders it among the registry's changes where the registry numbers them.
        """
        with self._lock:
            self._set(name, key)

    def _set(self, name: str, key: str | None) -> None:
        """Change one name (hold ``_lock``); copy-on-write so readers never see a dict mid-change."""
        if self._keys.get(name) == key:
            return
        keys = dict(self._keys)
        if key is None:
            keys.pop(name, None)
        else:
            keys[name] = key
        self._keys = keys

    def _replace(self, keys: dict[str, str]) -> None:
        """Take a whole new map (hold ``_lock``)."""
        self._keys = dict(keys)

    # ---- the catalog thread -----------------------------------------------------------
    def _tick(self) -> float:
        """One bounded unit of work (at most about a second of blocking); returns the seconds to
        wait before the next. Raises when the registry cannot be reached."""
        raise NotImplementedError

    def _disconnect(self) -> None:
        """Drop the connection to the registry, if any (after a failure, and at close)."""

    def _mark_up(self) -> None:
        self._backoff_s = BACKOFF_MIN_S
        if not self._up:
            self._up = True
            if self._down_since is not None:
                logger.info(
                    "adapter registry %s is reachable again after %.1f s; its adapters are served again",
                    self.description,
                    time.monotonic() - self._down_since,
                )
            self._down_since = None
        self._ready.set()

    def _failed(self, error: BaseException) -> float:
        """Record a failed attempt; return how long to wait before the next one."""
        try:
            self._disconnect()
        except Exception:  # a broken connection may fail to close; it is dropped either way
            logger.debug("closing the connection to %s failed", self.description, exc_info=True)
        self._last_error = f"{type(error).__name__}: {error}"
        if self._up or self._down_since is None:  # once per outage, not once per attempt
            self._down_since = time.monotonic()
            logger.warning(
                "adapter registry %s is unreachable (%s): adapters resident on this replica are still "
                "served, requests that need the registry fail with 503; reconnecting in the background",
                self.description,
                self._last_error,
            )
        else:
            logger.debug("adapter registry %s still unreachable: %s", self.description, self._last_error)
        self._up = False
        self._ready.set()
        delay = self._backoff_s * random.uniform(0.5, 1.0)
        self._backoff_s = min(self._backoff_s * 2, BACKOFF_MAX_S)
        return delay


def _run(ref: weakref.ReferenceType[AdapterCatalog], stop: threading.Event) -> None:
    """The catalog thread: tick until stopped or until the catalog is garbage (weak reference)."""
    while not stop.is_set():
        catalog = ref()
        if catalog is None:
            return
        try:
            delay = catalog._tick()
        except Exception as error:  # the registry is unreachable or misbehaves: back off, retry
            delay = catalog._failed(error)
        del catalog  # hold no strong reference while waiting
        if delay > 0:
            stop.wait(delay)


class PollingCatalog(AdapterCatalog):
    """A catalog for stores without change notifications: re-reads ``read_index()`` when
    ``change_token()`` (cheap: a stat) differs from the last read, is None (the store cannot
    tell), or the last read is ``max_age_s`` old.

    Another process's change is seen within ``interval_s`` (the store's change token permitting);
    this process's own changes at once (:meth:`note`). A failing read marks the registry down.

    ``probe``, when a store has one that costs about a system call (the directory store: one
    ``readlink``), answers :meth:`lookup` directly instead of the map, so a change made by another
    process is seen at once, as a single server with a local directory always did; the map then
    serves ``names`` and ``num_names``, and the map again answers lookups if the probe fails.
    """

    def __init__(
        self,
        read_index: Callable[[], dict[str, str]],
        change_token: Callable[[], Hashable | None],
        description: str,
        *,
        probe: Callable[[str], str | None] | None = None,
        interval_s: float = 0.2,
        max_age_s: float = 5.0,
    ) -> None:
        super().__init__(description)
        self._read_index = read_index
        self._change_token = change_token
        self._probe = probe
        self.interval_s = interval_s
        self.max_age_s = max_age_s
        self._token: Hashable | None = None
        self._read_at = -float("inf")
        self._generation = 0  # counts notes, so a read that raced with one is not taken

    def lookup(self, name: str) -> str | None:
        if self._probe is not None:
            try:
                return self._probe(name)
            except OSError:  # the directory cannot be read now: the last map (the poll marks it down)
                pass
        return super().lookup(name)

    def note(self, name: str, key: str | None, seq: int | None = None) -> None:
        with self._lock:
            self._generation += 1
            self._set(name, key)

    def _tick(self) -> float:
        token = self._change_token()  # before the read: a change after it moves the token again
        now = time.monotonic()
        if self._up and token is not None and token == self._token and now - self._read_at < self.max_age_s:
            return self.interval_s
        generation = self._generation
        keys = self._read_index()
        with self._lock:
            if self._generation == generation:
                self._replace(keys)
                self._token, self._read_at = token, now
            else:  # a note landed during the read, which may predate it: read again next tick
                self._token = None
        self._mark_up()
        return self.interval_s
