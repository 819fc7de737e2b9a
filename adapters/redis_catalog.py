"""The catalog of a Redis registry: a snapshot of the name index, then every change as published.

The store numbers its changes (``{prefix}seq``) and publishes each one, in the transaction that
makes it, on ``{prefix}changes`` (:func:`encode_change`). This catalog subscribes first and
waits for Redis to confirm, then reads the index and the change number in one MULTI: every change
after that read arrives as a message, the ones already in the snapshot are recognised by their
number and skipped. After any connection loss (the outage dropped messages) it reconnects with
backoff and starts over from a new snapshot, so the map is revalidated as a whole.

It owns its own connection with redis-py's retries off: reconnection is this class's job, and a
silent reconnect inside redis-py would lose messages without a new snapshot. A connection that
stops answering (no message and no reply to a periodic PING) counts as lost, so a network
partition is noticed too, not only a server that closed the socket.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .catalog import AdapterCatalog

logger = logging.getLogger(__name__)

POLL_S = 0.5  # longest wait for a message before the thread checks for close and silence
PING_AFTER_S = 5.0  # a connection quiet this long is pinged
SILENT_LIMIT_S = 15.0  # a connection that answered nothing this long is considered lost
CONNECT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Change:
    """One change of the registry: ``name`` now maps to ``digest`` (None: deleted); ``seq`` its number."""

    seq: int
    name: str
    digest: str | None


def encode_change(change: Change) -> str:
    return json.dumps({"seq": change.seq, "name": change.name, "digest": change.digest})


def decode_change(data: bytes | str) -> Change:
    """Parse a published change; raises ValueError (or KeyError/TypeError) on a malformed one."""
    fields = json.loads(data)
    digest = fields["digest"]
    if not isinstance(fields["name"], str) or not (digest is None or isinstance(digest, str)):
        raise ValueError(f"malformed adapter registry change {data!r}")
    return Change(int(fields["seq"]), fields["name"], digest)


class RedisCatalog(AdapterCatalog):
    """Follows a :class:`~.redis_store.RedisStore`'s index; see the module docstring."""

    def __init__(self, url: str, *, index_key: str, seq_key: str, channel: str, description: str) -> None:
        super().__init__(description)
        self._url = url
        self._index_key, self._seq_key, self._channel = index_key, seq_key, channel
        self._client: redis.Redis | None = None
        self._pubsub: Any = None  # redis.client.PubSub while connected
        self._floor = -1  # every change numbered up to here is in the map
        self._ahead: dict[str, int] = {}  # name -> number of a noted change the stream has not reached yet
        self._heard_at = 0.0
        self._pinged_at = 0.0

    def note(self, name: str, key: str | None, seq: int | None = None) -> None:
        with self._lock:
            if seq is None:
                self._set(name, key)
            elif seq > self._floor and seq > self._ahead.get(name, -1):
                self._set(name, key)
                self._ahead[name] = seq

    def _tick(self) -> float:
        if self._pubsub is None:
            self._connect()
            return 0.0
        message = self._pubsub.get_message(timeout=POLL_S)
        now = time.monotonic()
        if message is not None:
            self._heard_at = now
            if message["type"] == "message":
                self._apply(message["data"])
        elif now - self._heard_at > SILENT_LIMIT_S:
            raise ConnectionError(f"no answer from Redis for {SILENT_LIMIT_S:.0f} s")
        elif now - max(self._heard_at, self._pinged_at) > PING_AFTER_S:
            self._pubsub.ping()  # its reply ("pong") arrives as a message
            self._pinged_at = now
        return 0.0

    def _connect(self) -> None:
        client = redis.Redis.from_url(
            self._url,
            retry=Retry(NoBackoff(), 0),
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=SILENT_LIMIT_S,
            socket_keepalive=True,
        )
        pubsub = client.pubsub()
        try:
            pubsub.subscribe(self._channel)
            # Only once Redis confirms the subscription is every later change sure to arrive.
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            while True:
                message = pubsub.get_message(timeout=CONNECT_TIMEOUT_S)
                if message is not None and message["type"] == "subscribe":
                    break
                if time.monotonic() > deadline:
                    raise ConnectionError(f"Redis did not confirm the subscription within {CONNECT_TIMEOUT_S} s")
            with client.pipeline(transaction=True) as pipe:
                pipe.hgetall(self._index_key)
                pipe.get(self._seq_key)
                raw_index, raw_seq = pipe.execute()
        except BaseException:
            pubsub.close()
            client.close()
            raise
        keys = {name.decode(): digest.decode() for name, digest in raw_index.items()}
        with self._lock:
            self._replace(keys)
            self._floor = int(raw_seq or 0)
            self._ahead = {}
        self._client, self._pubsub = client, pubsub
        self._heard_at = self._pinged_at = time.monotonic()
        logger.debug("adapter catalog of %s synced: %d names at change %d", self.description, len(keys), self._floor)
        self._mark_up()

    def _apply(self, data: bytes) -> None:
        try:
            change = decode_change(data)
        except (ValueError, KeyError, TypeError):
            logger.warning("ignoring a malformed message on %s: %r", self._channel, data[:200])
            return
        with self._lock:
            if change.seq <= self._floor:
                return  # already in the snapshot, or noted
            gap = change.seq > self._floor + 1
            if change.seq > self._ahead.get(change.name, -1):
                self._set(change.name, change.digest)
            self._floor = change.seq
            self._ahead = {name: seq for name, seq in self._ahead.items() if seq > change.seq}
        if gap:  # changes were numbered but never arrived: take a new snapshot (not an outage)
            logger.info("catalog of %s missed changes before %d: re-reading the index", self.description, change.seq)
            self._disconnect()

    def _disconnect(self) -> None:
        pubsub, client = self._pubsub, self._client
        self._pubsub = self._client = None
        if pubsub is not None:
            pubsub.close()
        if client is not None:
            client.close()
