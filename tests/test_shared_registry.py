"""Two engines ("replicas") sharing one Redis registry see the same, current adapters.

A change made through one replica reaches the other's catalog by Redis pub/sub, asynchronously
(about a millisecond): the test waits for it, at most 5 s, before using the other replica.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from adapter_factory import make_peft_adapter

from loraserve import LLM, SamplingParams

PROMPT = "Shared registries keep every replica in step. " * 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("replica-adapters")
    return {
        name: make_peft_adapter(tiny_hf_model, root / name, rank=8, target_modules=["q_proj", "v_proj"], seed=seed)
        for seed, name in enumerate(["old", "new"])
    }


def _run(llm: LLM, adapter: str) -> Any:
    return llm.generate([PROMPT], GREEDY, adapters=adapter, use_tqdm=False)[0]


def _wait_in_step(writer: LLM, reader: LLM, name: str) -> None:
    """Until ``reader``'s catalog maps ``name`` as ``writer``'s does (at most 5 s; a lost
    connection would take the 15 s silence limit)."""
    deadline = time.monotonic() + 5.0
    while reader.engine.adapters.resolver.source.lookup(name) != writer.engine.adapters.resolver.source.lookup(name):
        assert time.monotonic() < deadline, f"replica b did not see the change of {name!r} within 5 s"
        time.sleep(0.001)


def test_replicas_share_adapters_and_never_serve_stale_weights(
    tiny_model_dir: Path, adapter_dirs: dict[str, Path], redis_url: str
) -> None:
    registry = f"{redis_url}"
    replica_a = LLM(str(tiny_model_dir), registry=registry, num_pages=128)
    replica_b = LLM(str(tiny_model_dir), registry=registry, num_pages=128)
    replica_a.add_adapter("shared", adapter_dirs["old"])
    assert [info.name for info in replica_b.list_adapters()] == ["shared"]  # asks the registry
    _wait_in_step(replica_a, replica_b, "shared")
    old_on_b = _run(replica_b, "shared")
    assert _run(replica_b, "shared").num_cached_tokens > 0
    assert old_on_b.token_ids == _run(replica_a, "shared").token_ids

    replica_a.remove_adapter("shared")
    replica_a.add_adapter("shared", adapter_dirs["new"])
    _wait_in_step(replica_a, replica_b, "shared")
    new_on_b = _run(replica_b, "shared")
    assert new_on_b.num_cached_tokens == 0  # the old weights' KV is never reused
    assert new_on_b.token_ids == _run(replica_a, "shared").token_ids
    assert new_on_b.token_ids != old_on_b.token_ids
    assert replica_b.list_adapters()[0].digest == replica_a.list_adapters()[0].digest

    replica_a.remove_adapter("shared")
    _wait_in_step(replica_a, replica_b, "shared")
    with pytest.raises(KeyError, match="not registered"):
        _run(replica_b, "shared")


def test_a_stored_adapter_past_this_servers_rank_limit_fails_only_its_requests(
    tiny_model_dir: Path, tiny_hf_model: Any, tmp_path: Path
) -> None:
    """A store written by a server with a higher ``max_lora_rank``: here the adapter above the limit
    is left out of the list and its request ends with the reason, while the others are served (with
    a fixed region, its pages would not fit a slot sized for the limit)."""
    registry = f"dir:{tmp_path / 'registry'}"
    ranks = {"big": 16, "small": 4}
    writer = LLM(str(tiny_model_dir), registry=registry, num_pages=128)
    for seed, (name, rank) in enumerate(ranks.items()):
        adapter = make_peft_adapter(tiny_hf_model, tmp_path / name, rank=rank, target_modules=["q_proj"], seed=seed)
        writer.add_adapter(name, adapter)
    reference = writer.generate([PROMPT], GREEDY, adapters="small", use_tqdm=False)[0]
    del writer
    reader = LLM(str(tiny_model_dir), registry=registry, num_pages=128, adapter_region="fixed", max_loras=2,
                 max_lora_rank=8)  # fmt: skip
    assert [info.name for info in reader.list_adapters()] == ["small"]
    big, small = reader.generate([PROMPT, PROMPT], GREEDY, adapters=["big", "small"], use_tqdm=False)
    assert big.error is not None and "above this server's limit of 8" in big.error
    assert small.error is None and small.token_ids == reference.token_ids
    assert reader.generate([PROMPT], GREEDY, use_tqdm=False)[0].error is None  # the engine serves on
