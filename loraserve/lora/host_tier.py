"""Parsed adapters kept in host memory: an LRU bounded in bytes that never drops an adapter some
unfinished sequence still needs.

It is the middle tier of adapter residency (``residency.py``): the registry's files are read and
parsed into it, and a load into the page pool copies from it. It also remembers which content
key each adapter in it was read under, so a name that resolves to a known key needs no read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from loraserve.adapters import LoRAAdapter


class HostTier:
    """Adapters by digest, least recently used first; ``capacity_bytes`` bounds their
    ``num_bytes`` except for adapters with live sequences, which are never dropped."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._key_digests: dict[str, str] = {}  # content key -> digest, while that adapter is here
        self._num_live_seqs: dict[str, int] = {}

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._adapters

    def __iter__(self) -> Iterator[str]:
        """Digests, least recently used first."""
        return iter(list(self._adapters))

    @property
    def num_bytes(self) -> int:
        """Bytes of the adapters held."""
        return sum(adapter.num_bytes for adapter in self._adapters.values())

    @property
    def live_seqs(self) -> dict[str, int]:
        """Unfinished sequences per adapter that has any (a copy)."""
        return dict(self._num_live_seqs)

    def digest_of_key(self, key: str) -> str | None:
        """The digest of the adapter read under content key ``key`` if it is here (it becomes the
        most recently used), else None."""
        digest = self._key_digests.get(key)
        if digest is None or digest not in self._adapters:
            return None
        self._adapters.move_to_end(digest)
        return digest

    def put(self, key: str, adapter: LoRAAdapter) -> None:
        """Keep ``adapter``, read under content key ``key``, as the most recently used (not
        trimmed here: it is about to get a live sequence)."""
        self._key_digests[key] = adapter.digest
        self._adapters[adapter.digest] = adapter
        self._adapters.move_to_end(adapter.digest)

    def get(self, adapter_id: str) -> LoRAAdapter | None:
        """The adapter if it is here (it becomes the most recently used), else None."""
        adapter = self._adapters.get(adapter_id)
        if adapter is not None:
            self._adapters.move_to_end(adapter_id)
        return adapter

    def add_live_seq(self, adapter_id: str) -> list[str]:
        """Count an unfinished sequence on the adapter; returns the digests trimmed to make room."""
        self._num_live_seqs[adapter_id] = self._num_live_seqs.get(adapter_id, 0) + 1
        return self._trim()

    def drop_live_seq(self, adapter_id: str) -> list[str]:
        """Drop one sequence's count; returns the digests trimmed once the adapter has none left."""
        remaining = self._num_live_seqs[adapter_id] - 1
        if remaining:
            self._num_live_seqs[adapter_id] = remaining
            return []
        del self._num_live_seqs[adapter_id]
        return self._trim()

    def _trim(self) -> list[str]:
        """Drop least recently used adapters without live sequences while over capacity."""
        total = self.num_bytes
        trimmed: list[str] = []
        for adapter_id in list(self._adapters):
            if total <= self.capacity_bytes:
                break
            if adapter_id in self._num_live_seqs:
                continue
            total -= self._adapters.pop(adapter_id).num_bytes
            trimmed.append(adapter_id)
        if trimmed:  # keys of content no longer here would only be looked up to miss
            self._key_digests = {key: d for key, d in self._key_digests.items() if d in self._adapters}
        return trimmed
