"""The host tier alone: an LRU of parsed adapters bounded in bytes, never dropping an adapter
with live sequences, and forgetting content keys whose adapter it dropped."""

from __future__ import annotations

import torch
from loraserve.adapters import LoRAAdapter
from loraserve.adapters.lora_weights import LoRAModuleWeights

from loraserve.lora.host_tier import HostTier


def adapter(digest: str, rank: int = 2) -> LoRAAdapter:
    weights = LoRAModuleWeights(torch.zeros(rank, 4), torch.zeros(4, rank), 1.0)  # 16 * rank bytes
    return LoRAAdapter(name=digest, digest=digest, weights={(0, "q_proj"): weights})


def test_lru_bounded_in_bytes_keeps_adapters_with_live_sequences() -> None:
    tier = HostTier(capacity_bytes=2 * adapter("x").num_bytes)
    for digest in "abc":
        tier.put(f"key-{digest}", adapter(digest))
    assert list(tier) == ["a", "b", "c"] and tier.num_bytes == 3 * 64
    assert tier.add_live_seq("a") == ["b"]  # over capacity: the least recently used idle one goes
    assert list(tier) == ["a", "c"] and tier.digest_of_key("key-b") is None
    tier.put("key-d", adapter("d"))
    assert tier.add_live_seq("d") == ["c"]  # "a" is older but has a live sequence
    assert tier.add_live_seq("d") == [] and tier.live_seqs == {"a": 1, "d": 2}
    assert tier.drop_live_seq("d") == [] and list(tier) == ["a", "d"]
    tier.capacity_bytes = 0
    assert tier.drop_live_seq("a") == ["a"] and list(tier) == ["d"]  # "d" still has a sequence
    assert tier.drop_live_seq("d") == ["d"] and list(tier) == [] and tier.live_seqs == {}


def test_lookups_by_key_and_digest_refresh_recency() -> None:
    tier = HostTier(capacity_bytes=2 * adapter("x").num_bytes)
    tier.put("key-a", adapter("a"))
    tier.put("key-b", adapter("b"))
    assert tier.digest_of_key("key-a") == "a" and list(tier) == ["b", "a"]
    assert tier.get("b") is not None and list(tier) == ["a", "b"]
    assert tier.get("z") is None and tier.digest_of_key("key-z") is None
    tier.put("key-c", adapter("c"))
    tier.add_live_seq("c")
    assert list(tier) == ["b", "c"] and "a" not in tier and "b" in tier
