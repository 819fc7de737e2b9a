"""The engine's memory, built from its config: the page pool (or the pool and a fixed adapter
region), the KV cache manager over it, and the adapter registry and residency manager.

Built once when the engine starts; the engine keeps the parts and closes the adapters' threads
(and a private registry directory) with ``close_adapters``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import torch

from loraserve.adapters import AdapterLimits, AdapterRegistry, BaseModelShapes, make_store
from loraserve.config import EngineConfig
from loraserve.kv_cache_manager import KVCacheManager, ReservingKVCacheManager, tokens_at_most
from loraserve.lora.residency import AdapterManager
from loraserve.page_layout import PageLayout
from loraserve.page_pool import PagePool
from loraserve.page_pools import PagePools


@dataclass(frozen=True)
class EngineMemory:
    pools: PagePools
    num_pages: int  # pages of the pool (KV blocks, and adapters when unified)
    page_bytes: int  # bytes of one page id across all layers
    kv_manager: KVCacheManager
    adapter_registry: AdapterRegistry
    adapters: AdapterManager
    private_registry_dir: str | None  # a temporary registry directory, when the config names none

    @classmethod
    def build(cls, config: EngineConfig, layout: PageLayout, shapes: BaseModelShapes) -> EngineMemory:
        page_bytes = layout.page_bytes(config.torch_dtype)
        num_pages = config.num_pages or max(2, config.memory_budget_mb * 2**20 // page_bytes)
        pools = PagePools.build(config, num_pages, shapes, layout.page_elems)
        host_pool = PagePool(config.num_swap_pages) if config.num_swap_pages else None
        num_watermark_pages = int(config.watermark * pools.kv.num_pages)
        kv_options = (num_watermark_pages, host_pool, config.enable_prefix_caching)
        kv_manager: KVCacheManager
        if config.kv_allocation == "reserve":
            kv_manager = ReservingKVCacheManager(pools.kv, config.block_size, tokens_at_most, *kv_options)
        else:
            kv_manager = KVCacheManager(pools.kv, config.block_size, *kv_options)
        private_registry = tempfile.mkdtemp(prefix="loraserve-adapters-") if config.registry is None else None
        registry = AdapterRegistry(
            make_store(private_registry or config.registry),
            shapes,
            limits=AdapterLimits(max_rank=config.max_lora_rank, max_adapters=config.max_adapters),
        )
        adapters = AdapterManager(
            registry,
            pools.adapters,
            layout.num_layers,
            layout.page_elems,
            config.host_adapter_cache_mb * 2**20,
            num_watermark_pages if pools.unified else 0,
            pages_per_adapter=pools.slot_pages,
            parse_in_background=host_cores_to_spare(config.device),
        )
        return cls(pools, num_pages, page_bytes, kv_manager, registry, adapters, private_registry)


def host_cores_to_spare(device: str) -> bool:
    """Whether the forward leaves host cores idle for other work (here, parsing adapters on the loader
    thread): on a GPU, or on a CPU engine with fewer torch threads than the cores it may use."""
    if torch.device(device).type != "cpu":
        return True
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return torch.get_num_threads() < usable


def close_adapters(adapters: AdapterManager, private_registry: str | None) -> None:
    """Stop the adapter manager's threads, then remove a private registry directory."""
    adapters.close()
    if private_registry is not None:
        shutil.rmtree(private_registry, ignore_errors=True)
