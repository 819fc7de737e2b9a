"""Content hashes of full KV blocks and the map from hash to the page holding it.

Block ``j`` of a sequence hashes ``sha256(parent_hash, its block_size token ids,
extra keys)`` where the extra keys are the adapter's content digest (never its
name) and the request's ``cache_salt``. So two requests share a cached block only
when they have the same tokens up to and including it, the same adapter weights
and the same salt; re-registering different weights under an old name yields a
different digest and so different hashes.
"""

from __future__ import annotations

import hashlib
from array import array

from loraserve.sequence import Sequence

_ROOT_HASH = b"loraserve-prefix-v1"


def block_hash(parent: bytes, token_ids: list[int], adapter_id: str | None, cache_salt: str | None) -> bytes:
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    digest.update(b"\x00adapter:" + (adapter_id or "").encode())
    digest.update(b"\x00salt:" + (cache_salt or "").encode() if cache_salt is not None else b"\x00nosalt")
    return digest.digest()


def extend_block_hashes(seq: Sequence, num_full_blocks: int, block_size: int) -> list[bytes]:
    """Hashes of the sequence's first ``num_full_blocks`` blocks (memoised on the sequence)."""
    hashes = seq.block_hashes
    while len(hashes) < num_full_blocks:
        start = len(hashes) * block_size
        parent = hashes[-1] if hashes else _ROOT_HASH
        hashes.append(block_hash(parent, seq.token_ids[start : start + block_size], seq.adapter_id, seq.cache_salt))
    return hashes[:num_full_blocks]


class PrefixCacheIndex:
    """Which page holds the block with a given hash; each page holds at most one hash."""

    def __init__(self) -> None:
        self._page_by_hash: dict[bytes, int] = {}
        self._hash_by_page: dict[int, bytes] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def __len__(self) -> int:
        return len(self._page_by_hash)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._page_by_hash.get(block_hash)

    def hash_of(self, page_id: int) -> bytes | None:
        return self._hash_by_page.get(page_id)

    def insert(self, block_hash: bytes, page_id: int) -> bool:
        """Register a freshly filled page; False if another page already holds that block."""
        if block_hash in self._page_by_hash or page_id in self._hash_by_page:
            return False
        self._page_by_hash[block_hash] = page_id
        self._hash_by_page[page_id] = block_hash
        return True

    def remove_page(self, page_id: int) -> None:
        block_hash = self._hash_by_page.pop(page_id)
        del self._page_by_hash[block_hash]

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
