"""``make_store``: an adapter store from a spec (``dir:/path``, a plain path, ``redis://...``).

Kept apart from both stores so that neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable

from .local_store import LocalDirStore
from .redis_store import RedisStore
from .store import AdapterStore


def _make_dir_store(spec: str) -> AdapterStore:
    return LocalDirStore(spec.removeprefix("dir:"))


def _make_redis_store(spec: str) -> AdapterStore:
    return RedisStore(spec)


# Store kinds by the scheme before the first ":". A spec with an unregistered scheme is a plain path.
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
    """Build a store from a spec: ``"dir:/path"`` or ``"/path"`` (local), ``"redis://host:port/db"`` (Redis)."""
    scheme = spec.partition(":")[0]
    factory = STORE_FACTORIES.get(scheme, _make_dir_store)
    return factory(spec)
