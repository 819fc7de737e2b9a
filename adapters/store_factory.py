"""``make_store``: an adapter store from a spec (``dir:/path``, a plain path, ``redis://...``).

Kept apart from both stores so that neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable

from .local_store import LocalDirStore
from .redis_store import RedisStore
from .store import AdapterStore


def _make_dir_store(spec: str) -> AdapterStore:
    path = spec.removeprefix("dir:")
    if not path:
        raise ValueError("registry 'dir:' names no directory: give dir:PATH")
    return LocalDirStore(path)


def _make_redis_store(spec: str) -> AdapterStore:
    return RedisStore(spec)


# Store kinds by the scheme before the first ":". A spec without ":" before its first "/" is a plain
# path; any other scheme is refused (a mistyped "Redis://" or "host:6379" is not made a directory).
STORE_FACTORIES: dict[str, Callable[[str], AdapterStore]] = {
    "dir": _make_dir_store,
    "redis": _make_redis_store,
    "rediss": _make_redis_store,
    "unix": _make_redis_store,
}


def register_store_scheme(scheme: str, factory: Callable[[str], AdapterStore]) -> None:
    """Add a store kind: ``make_store(f"{scheme}:...")`` will call ``factory`` with the whole spec."""
    STORE_FACTORIES[scheme] = factory


def is_directory_spec(spec: str) -> bool:
    """Whether ``spec`` names a local directory store (one machine's: not shared across a cluster)."""
    return STORE_FACTORIES.get(spec.partition(":")[0], _make_dir_store) is _make_dir_store


def make_store(spec: str) -> AdapterStore:
    """Build a store from a spec: ``"dir:/path"`` or ``"/path"`` (local), ``"redis://host:port/db"`` (Redis);
    ``ValueError`` for an unknown scheme (a path with ":" in its first part is given as ``dir:PATH``)."""
    scheme, colon, _ = spec.partition(":")
    if not spec:
        raise ValueError("the registry spec is empty: give dir:PATH or redis://HOST:PORT/DB")
    if colon and "/" not in scheme and scheme not in STORE_FACTORIES:
        known = ", ".join(f"{name}:" for name in STORE_FACTORIES)
        raise ValueError(
            f"registry {spec!r}: unknown scheme {scheme!r} (known: {known} or a plain path; "
            f"a directory whose name has ':' is given as dir:PATH)"
        )
    return STORE_FACTORIES.get(scheme, _make_dir_store)(spec)
