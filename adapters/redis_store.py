"""An adapter store in Redis, so that every server replica sees the same adapter set.

Layout under ``prefix`` (weights stored once per content digest, names pointing at digests):

* ``{prefix}index``: hash, adapter name -> content digest (:func:`.store.content_digest`, sha256 hex).
* ``{prefix}blob:{digest}``: hash, the files of that content. Field ``manifest`` is JSON
  ``[[file name, size, number of chunks], ...]``; field ``{i}:{j}`` is chunk ``j`` of file ``i``.
  Files are cut into chunks of ``chunk_size`` bytes (64 MiB), so no value nears Redis's limit on
  one value (512 MiB) and no reply holds more than one chunk.
* ``{prefix}refs:{digest}``: set of the names that map to the digest; when the last one goes (a
  delete, or an overwrite with other content), the blob goes with it.
* ``{prefix}seq``: the number of the last change; ``{prefix}changes``: a pub/sub channel carrying
  each change (:func:`.redis_catalog.encode_change`) for the replicas' catalogs.
* ``{prefix}upload:{random}``: a blob being written, renamed to ``blob:{digest}`` by the
  transaction that publishes it; it expires after an hour if its writer dies first.

Every change of index, refs, blob and seq, and its message, is one WATCH/MULTI/EXEC transaction,
so readers never see a name pointing at a missing or partial blob; a reader racing a delete finds
the blob gone and looks again (``get``) or reports the content gone (``get_content``). Reads check
the digest of what they assembled. Redis errors surface as :class:`RegistryUnavailableError`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis

from .catalog import AdapterCatalog
from .errors import AdapterError, AdapterExistsError, AdapterNotFoundError, RegistryUnavailableError
from .redis_catalog import Change, RedisCatalog, encode_change
from .store import AdapterStore, content_digest, validate_adapter_name, validate_file_names

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024**2
UPLOAD_TTL_S = 3600
_READ_ATTEMPTS = 50  # a get racing overwrites of its name re-reads; each overwrite takes longer than a read
_DIGEST_PATTERN = re.compile(r"[0-9a-f]{64}")


class _BlobGone(Exception):
    """The blob was deleted while being read or published (raced with a delete or an overwrite)."""


class RedisStore(AdapterStore):
    """Adapters in a Redis server shared by several replicas; see the module docstring for the layout.

    ``client`` replaces the client built from ``url`` for commands; the catalog (``open_catalog``)
    always connects to ``url`` itself, with its own reconnection policy.
    """

    def __init__(
        self,
        url: str,
        prefix: str = "loraserve:",
        *,
        client: redis.Redis | None = None,
        chunk_size: int = CHUNK_BYTES,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.url = url
        self.prefix = prefix
        self.chunk_size = chunk_size
        self.description = f"{_redact(url)} (prefix {prefix!r})"  # in errors a client may see: no password
        # Binary responses: file contents are raw bytes.
        self._client: redis.Redis = (
            client
            if client is not None
            else redis.Redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=30.0, socket_keepalive=True)
        )
        self._index_key = f"{prefix}index"
        self._seq_key = f"{prefix}seq"
        self._channel = f"{prefix}changes"

    def __repr__(self) -> str:
        return f"RedisStore({_redact(self.url)!r}, prefix={self.prefix!r})"

    def _blob_key(self, digest: str) -> str:
        return f"{self.prefix}blob:{digest}"

    def _refs_key(self, digest: str) -> str:
        return f"{self.prefix}refs:{digest}"

    @contextlib.contextmanager
    def _unavailable_as_error(self) -> Iterator[None]:
        """Redis errors (unreachable, timing out, loading, out of memory) -> RegistryUnavailableError."""
        try:
            yield
        except redis.RedisError as error:
            raise RegistryUnavailableError(
                f"the adapter registry {self.description} is unavailable: {type(error).__name__}: {error}"
            ) from error

    # ---- writes ---------------------------------------------------------------------
    def put(self, name: str, files: Mapping[str, bytes], *, overwrite: bool = False) -> None:
        validate_adapter_name(name)
        validate_file_names(files)
        contents = {file_name: bytes(content) for file_name, content in files.items()}
        digest = content_digest(contents)
        staged: str | None = None
        with self._unavailable_as_error():
            try:
                while True:
                    # Identical content already stored (another name): nothing to upload.
                    if staged is None and not self._client.exists(self._blob_key(digest)):
                        staged = self._stage(contents)
                    # Any: redis-py types the callable as returning None; value_from_callable returns its value.
                    publish: Any = functools.partial(
                        self._publish_put, name=name, digest=digest, staged=staged, overwrite=overwrite
                    )
                    try:
                        seq = self._client.transaction(
                            publish,
                            self._index_key,
                            self._seq_key,
                            self._blob_key(digest),
                            self._refs_key(digest),
                            value_from_callable=True,
                        )
                        break
                    except _BlobGone:  # deleted between our check and the transaction: upload it after all
                        continue
            finally:
                if staged is not None:  # renamed into place, or not needed: gone either way
                    with contextlib.suppress(redis.RedisError):
                        self._client.delete(staged)
        self._notify(name, digest, cast(int, seq))
        logger.info("stored adapter %s (content %s) in %r", name, digest[:12], self)

    def _stage(self, files: Mapping[str, bytes]) -> str:
        """Write ``files`` as a blob under a temporary key (outside any transaction: it may be large)."""
        staged = f"{self.prefix}upload:{uuid.uuid4().hex}"
        manifest = []
        pipe = self._client.pipeline(transaction=False)
        pipe.hset(staged, "manifest", "[]")
        pipe.expire(staged, UPLOAD_TTL_S)
        for index, (file_name, content) in enumerate(sorted(files.items())):
            num_chunks = max(1, -(-len(content) // self.chunk_size))
            manifest.append([file_name, len(content), num_chunks])
            for chunk in range(num_chunks):
                # One command per chunk: Redis parses a command at a time, so none nears its limits.
                pipe.hset(staged, f"{index}:{chunk}", content[chunk * self.chunk_size : (chunk + 1) * self.chunk_size])
        pipe.hset(staged, "manifest", json.dumps(manifest))
        pipe.execute()
        return staged

    def _publish_put(self, pipe: Any, name: str, digest: str, staged: str | None, overwrite: bool) -> int:
        """Under WATCH: point ``name`` at ``digest`` (placing the staged blob if it is not stored yet),
        drop the old content if nothing else references it, and publish the change."""
        raw_old = pipe.hget(self._index_key, name)
        old = raw_old.decode() if raw_old is not None else None
        if old is not None and not overwrite:
            raise AdapterExistsError(f"adapter {name!r} already exists")
        blob_stored = bool(pipe.exists(self._blob_key(digest)))
        if not blob_stored and staged is None:
            raise _BlobGone
        drop_old = False
        if old is not None and old != digest:
            pipe.watch(self._refs_key(old))
            drop_old = set(pipe.smembers(self._refs_key(old))) <= {name.encode()}
        seq = int(pipe.get(self._seq_key) or 0) + 1
        pipe.multi()
        if not blob_stored:
            pipe.rename(staged, self._blob_key(digest))
            pipe.persist(self._blob_key(digest))
        pipe.hset(self._index_key, name, digest)
        pipe.sadd(self._refs_key(digest), name)
        if old is not None and old != digest:
            pipe.srem(self._refs_key(old), name)
            if drop_old:
                pipe.delete(self._blob_key(old), self._refs_key(old))
        pipe.set(self._seq_key, seq)
        pipe.publish(self._channel, encode_change(Change(seq, name, digest)))
        return seq

    def delete(self, name: str) -> None:
        validate_adapter_name(name)

        def unpublish(pipe: Any) -> Any:  # the change's number (Any: see put)
            raw = pipe.hget(self._index_key, name)
            if raw is None:
                raise AdapterNotFoundError(f"adapter {name!r} not found")
            digest = raw.decode()
            pipe.watch(self._refs_key(digest))
            last = set(pipe.smembers(self._refs_key(digest))) <= {name.encode()}
            seq = int(pipe.get(self._seq_key) or 0) + 1
            pipe.multi()
            pipe.hdel(self._index_key, name)
            pipe.srem(self._refs_key(digest), name)
            if last:  # no other name has this content: its weights go too
                pipe.delete(self._blob_key(digest), self._refs_key(digest))
            pipe.set(self._seq_key, seq)
            pipe.publish(self._channel, encode_change(Change(seq, name, None)))
            return seq

        with self._unavailable_as_error():
            seq = self._client.transaction(unpublish, self._index_key, self._seq_key, value_from_callable=True)
        self._notify(name, None, cast(int, seq))
        logger.info("deleted adapter %s from %r", name, self)

    # ---- reads ----------------------------------------------------------------------
    def get(self, name: str) -> dict[str, bytes]:
        validate_adapter_name(name)
        for _ in range(_READ_ATTEMPTS):
            digest = self.content_key(name)
            try:
                return self._read_blob(digest)
            except _BlobGone:  # the name was rewritten or deleted meanwhile: look again
                time.sleep(0.001)
        raise AdapterError(f"adapter {name!r} changed {_READ_ATTEMPTS} times while being read from {self!r}")

    def get_content(self, key: str) -> dict[str, bytes]:
        if not isinstance(key, str) or _DIGEST_PATTERN.fullmatch(key) is None:
            raise AdapterNotFoundError(f"no adapter content {key!r} in {self!r}: content keys are sha256 digests")
        try:
            return self._read_blob(key)
        except _BlobGone:
            raise AdapterNotFoundError(f"adapter content {key[:12]} is no longer stored in {self!r}") from None

    def _read_blob(self, digest: str) -> dict[str, bytes]:
        """The files of blob ``digest``, checked against it; _BlobGone if it is (or goes) missing."""
        blob = self._blob_key(digest)
        with self._unavailable_as_error():
            raw_manifest = self._client.hget(blob, "manifest")
            if raw_manifest is None:
                raise _BlobGone
            manifest = json.loads(raw_manifest)
            chunks: list[bytes | None] = []
            for batch in _batches(manifest, self.chunk_size):
                chunks += self._client.hmget(blob, batch)  # type: ignore[arg-type]
        if any(chunk is None for chunk in chunks):
            raise _BlobGone
        files: dict[str, bytes] = {}
        position = 0
        for file_name, size, count in manifest:
            files[file_name] = b"".join(chunks[position : position + count])  # type: ignore[arg-type]
            position += count
            if len(files[file_name]) != size:
                raise AdapterError(f"adapter content {digest[:12]} in {self!r} is damaged: {file_name} is truncated")
        if content_digest(files) != digest:
            raise AdapterError(f"adapter content {digest[:12]} in {self!r} is damaged: its digest does not match")
        return files

    def names(self) -> list[str]:
        with self._unavailable_as_error():
            names: list[bytes] = self._client.hkeys(self._index_key)  # type: ignore[assignment]
        return sorted(name.decode() for name in names)

    def contains(self, name: str) -> bool:
        with self._unavailable_as_error():
            return bool(self._client.hexists(self._index_key, validate_adapter_name(name)))

    def content_key(self, name: str) -> str:
        """The content digest ``name`` maps to."""
        with self._unavailable_as_error():
            raw = self._client.hget(self._index_key, validate_adapter_name(name))
        if raw is None:
            raise AdapterNotFoundError(f"adapter {name!r} not found")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def index(self) -> dict[str, str]:
        with self._unavailable_as_error():
            raw: dict[bytes, bytes] = self._client.hgetall(self._index_key)  # type: ignore[assignment]
        return {name.decode(): digest.decode() for name, digest in raw.items()}

    def num_blobs(self) -> int:
        """How many distinct contents are stored (for tests and operators; scans the prefix)."""
        with self._unavailable_as_error():
            return sum(1 for _ in self._client.scan_iter(match=f"{self.prefix}blob:*", count=1000))

    # ---- catalog and lifetime ---------------------------------------------------------
    def open_catalog(self) -> AdapterCatalog:
        """A started :class:`RedisCatalog`: the index, kept current through pub/sub."""
        catalog = RedisCatalog(
            self.url,
            index_key=self._index_key,
            seq_key=self._seq_key,
            channel=self._channel,
            description=self.description,
        )
        return self._track(catalog).start()

    def close(self) -> None:
        """Release the connection pool."""
        self._client.close()


def _batches(manifest: list[list[Any]], chunk_size: int) -> Iterator[list[str]]:
    """The blob's chunk fields in order, grouped so that one reply carries at most about
    ``CHUNK_BYTES`` (a small adapter: one round trip; a big one: never one huge reply)."""
    batch: list[str] = []
    batch_bytes = 0
    for index, (_, size, count) in enumerate(manifest):
        for chunk in range(count):
            chunk_bytes = min(chunk_size, size - chunk * chunk_size)
            if batch and batch_bytes + chunk_bytes > CHUNK_BYTES:
                yield batch
                batch, batch_bytes = [], 0
            batch.append(f"{index}:{chunk}")
            batch_bytes += chunk_bytes
    if batch:
        yield batch


def _redact(url: str) -> str:
    """``url`` without its password, in the user part or the query (``?password=``, which redis-py
    also reads): it ends up in logs and in error messages clients see."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        credentials, _, host = netloc.rpartition("@")
        netloc = f"{credentials.partition(':')[0]}:***@{host}"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if parts.password is None and not any(key.lower() == "password" for key, _ in pairs):
        return url
    query = urlencode([(key, "***" if key.lower() == "password" else value) for key, value in pairs], safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))
