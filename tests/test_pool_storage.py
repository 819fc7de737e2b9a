"""The pool's copies before a step's forward (``PoolStorage.copy_pages``): an adapter load, a
swap-out and swap-in, a copy-on-write copy. Each puts exactly the right values in exactly its
pages, reads no value back from the device, and a swap-in or page copy is one write into the pool
over every layer. On a CUDA machine (``benchmarks.gpu``'s tests part) the pool is on the GPU: its
copies are then the pinned, non-blocking uploads.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from loraserve.adapters import LoRAAdapter, LoRAModuleWeights
from torch.utils._python_dispatch import TorchDispatchMode

from loraserve.lora.batch import AdapterLoad, AdapterPages
from loraserve.lora.layout import AdapterLayout
from loraserve.lora.weights import group_weights
from loraserve.page_layout import PageLayout
from loraserve.pool_storage import PoolStorage
from loraserve.scheduled_batch import ScheduledBatch

LAYOUT = PageLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)  # 128 elements a page
SHAPES = {"q_proj": (32, 32), "v_proj": (32, 16), "down_proj": (64, 32)}  # (in, out)
NUM_PAGES = 24
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WRITES = {"aten.copy_.default", "aten.index_copy_.default", "aten.index_put_.default"}


class PoolWrites(TorchDispatchMode):
    """Counts in-place writes into the pool's storage, and reads of device values by the host."""

    def __init__(self, storage: torch.Tensor) -> None:
        super().__init__()
        self.pool_ptr = storage.untyped_storage().data_ptr()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in WRITES and target is not None and target.untyped_storage().data_ptr() == self.pool_ptr:
            self.ops["pool writes"] += 1
        if name == "aten._local_scalar_dense.default":
            self.ops["host reads"] += 1
        return func(*args, **(kwargs or {}))


def random_adapter(rank: int, seed: int) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {
        (layer, module): LoRAModuleWeights(
            torch.randn(rank, fan_in, generator=gen), torch.randn(fan_out, rank, generator=gen), 0.5
        )
        for layer in range(LAYOUT.num_layers)
        for module, (fan_in, fan_out) in SHAPES.items()
    }
    return LoRAAdapter(name=f"r{rank}", digest=f"d{seed}", weights=weights)


def pool(dtype: torch.dtype = torch.float32) -> PoolStorage:
    return PoolStorage(LAYOUT, num_pages=NUM_PAGES, num_swap_pages=4, dtype=dtype, device=DEVICE)


def copied(target: PoolStorage, batch: ScheduledBatch) -> collections.Counter[str]:
    with PoolWrites(target.storage) as writes:
        target.copy_pages(batch)
    return writes.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive", "scattered"])
def test_an_adapter_load_writes_exactly_its_pages(dtype: torch.dtype, scattered: bool) -> None:
    adapter = random_adapter(rank=5, seed=1)
    layout = AdapterLayout.for_adapter(adapter, LAYOUT.num_layers)
    count = layout.num_pages(LAYOUT.page_elems)  # 9: 1,040 elements a layer
    page_ids = tuple(range(2 * count, 0, -2)) if scattered else tuple(range(3, 3 + count))
    pages = AdapterPages("d1", page_ids, layout)
    target = pool(dtype)
    target.storage.fill_(7.0)  # what other pages hold must stay
    ops = copied(target, ScheduledBatch(seqs=[], num_new_tokens=[], adapter_loads=[AdapterLoad(pages, adapter)]))
    assert ops["host reads"] == 0
    others = [p for p in range(NUM_PAGES) if p not in page_ids]
    assert bool((target.storage[:, others] == 7.0).all())
    for layer in range(LAYOUT.num_layers):
        views = group_weights(target.storage, pages, layer)
        a, (q, _, v) = views["qkv"]
        expected_a = torch.cat([adapter.weights[(layer, m)].lora_a for m in ("q_proj", "v_proj")])  # [10, 32]
        assert torch.equal(a, expected_a.to(DEVICE, dtype))  # cast once, as the weights are read in float32
        for out, module in ((q, "q_proj"), (v, "v_proj")):
            assert out is not None and out.scale == 0.5
            assert torch.equal(out.b_t, adapter.weights[(layer, module)].lora_b.T.to(DEVICE, dtype))
        down_a, (down,) = views["down"]
        down_b_t = adapter.weights[(layer, "down_proj")].lora_b.T.to(DEVICE, dtype)
        assert torch.equal(down_a, adapter.weights[(layer, "down_proj")].lora_a.to(DEVICE, dtype))
        assert down is not None and torch.equal(down.b_t, down_b_t)


def test_swaps_and_copies_move_exactly_their_pages_in_one_write_each() -> None:
    target = pool()
    target.storage.copy_(torch.randn(target.storage.shape))
    original = target.storage.clone()
    assert (
        copied(target, ScheduledBatch(seqs=[], num_new_tokens=[], swap_out=[(5, 2), (11, 0)])) == {}
    )  # host-side writes only
    assert torch.equal(target.swap[:, [2, 0]], original[:, [5, 11]].cpu())
    target.storage[:, [5, 11]] = 0.0  # the pages are free and reused meanwhile
    ops = copied(target, ScheduledBatch(seqs=[], num_new_tokens=[], swap_in=[(0, 8), (2, 1)]))
    assert ops == {"pool writes": 1}
    assert torch.equal(target.storage[:, [8, 1]], original[:, [11, 5]])
    before = target.storage.clone()
    ops = copied(target, ScheduledBatch(seqs=[], num_new_tokens=[], copy_pages=[(8, 14), (3, 15)]))
    assert ops == {"pool writes": 1}
    assert torch.equal(target.storage[:, [14, 15]], before[:, [8, 3]])
    unchanged = [p for p in range(NUM_PAGES) if p not in (14, 15)]
    assert torch.equal(target.storage[:, unchanged], before[:, unchanged])
