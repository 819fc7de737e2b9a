"""An adapter store in Redis, so that every server replica sees the same adapter set.

Layout under ``prefix``: ``{prefix}adapter:{name}`` is a hash of file name -> bytes,
``{prefix}version:{name}`` a fresh random token per write, and ``{prefix}names`` a set of
adapter names. They change together in one MULTI/EXEC transaction.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

import redis

from .errors import AdapterExistsError, AdapterNotFoundError, AdapterTooLargeError
from .store import AdapterStore, validate_adapter_name, validate_file_names

logger = logging.getLogger(__name__)

# Redis refuses bulk strings above proto-max-bulk-len, 512 MiB by default.
MAX_FILE_BYTES = 512 * 1024**2


class RedisStore(AdapterStore):
    """Adapters in a Redis server shared by several replicas; see the module docstring for the layout."""

    def __init__(self, url: str, prefix: str = "loraserve:", *, client: redis.Redis | None = None) -> None:
        self.url = url
        self.prefix = prefix
        # Binary responses: file contents are raw bytes.
        self._client: redis.Redis = client if client is not None else redis.Redis.from_url(url)
        self._names_key = f"{prefix}names"

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, prefix={self.prefix!r})"

    def _key(self, name: str) -> str:
        return f"{self.prefix}adapter:{validate_adapter_name(name)}"

    def _version_key(self, name: str) -> str:
        return f"{self.prefix}version:{validate_adapter_name(name)}"

    def put(self, name: str, files: Mapping[str, bytes], *, overwrite: bool = False) -> None:
        key = self._key(name)
        validate_file_names(files)
        for file_name, content in files.items():
            if len(content) > MAX_FILE_BYTES:
                raise AdapterTooLargeError(
                    f"adapter file {file_name!r} is {len(content)} bytes; Redis stores at most {MAX_FILE_BYTES}"
                )
        mapping: dict[str | bytes, Any] = {file_name: bytes(content) for file_name, content in files.items()}

        def publish(pipe: Any) -> None:
            # Runs under WATCH: if another client changes the key before EXEC, redis-py retries.
            if not overwrite and pipe.exists(key):
                raise AdapterExistsError(f"adapter {name!r} already exists")
            pipe.multi()
            pipe.delete(key)
            pipe.hset(key, mapping=mapping)
            pipe.set(self._version_key(name), uuid.uuid4().hex)
            pipe.sadd(self._names_key, name)

        self._client.transaction(publish, key)
        logger.info("stored adapter %s in %r", name, self)

    def get(self, name: str) -> dict[str, bytes]:
        raw: dict[bytes, bytes] = self._client.hgetall(self._key(name))  # type: ignore[assignment]
        if not raw:
            raise AdapterNotFoundError(f"adapter {name!r} not found")
        return {file_name.decode(): content for file_name, content in sorted(raw.items())}

    def delete(self, name: str) -> None:
        key = self._key(name)
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(key)
        pipe.delete(self._version_key(name))
        pipe.srem(self._names_key, name)
        num_deleted, _, _ = pipe.execute()
        if not num_deleted:
            raise AdapterNotFoundError(f"adapter {name!r} not found")

    def names(self) -> list[str]:
        members: set[bytes] = self._client.smembers(self._names_key)  # type: ignore[assignment]
        return sorted(member.decode() for member in members)

    def contains(self, name: str) -> bool:
        return bool(self._client.exists(self._key(name)))

    def version(self, name: str) -> str:
        token = self._client.get(self._version_key(name))
        if token is None:
            raise AdapterNotFoundError(f"adapter {name!r} not found")
        return token.decode() if isinstance(token, bytes) else str(token)

    def close(self) -> None:
        """Release the connection pool."""
        self._client.close()
