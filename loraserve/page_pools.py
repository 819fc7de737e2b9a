"""How the storage's pages are split between the KV cache and adapters (``EngineConfig.adapter_region``).

* ``unified`` (S-LoRA's design): one pool; an adapter takes as many pages as its ranks need, and
  KV blocks and adapters trade pages as the load changes.
* ``fixed`` (the ablation: vLLM's and SGLang's design): the last ``max_loras`` slots of pages,
  each sized for an adapter of every module at ``max_lora_rank``, form the adapters' own pool,
  which the KV cache never gets.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.adapters import BaseModelShapes
from loraserve.config import ConfigError, EngineConfig
from loraserve.lora.layout import max_rank_pages
from loraserve.page_pool import PageKind, PagePool


@dataclass(frozen=True)
class PagePools:
    """The pool KV blocks take pages from and the one adapters do (the same object when unified)."""

    kv: PagePool
    adapters: PagePool
    slot_pages: int | None = None  # pages of one fixed-region slot; None when unified

    @classmethod
    def build(cls, config: EngineConfig, num_pages: int, shapes: BaseModelShapes, page_elems: int) -> PagePools:
        """Split ``num_pages`` page ids as ``config.adapter_region`` says (``ConfigError`` if a
        fixed region would leave the KV cache nothing)."""
        if config.adapter_region == "unified":
            pool = PagePool(num_pages)
            return cls(pool, pool)
        assert config.max_loras is not None  # the config requires it with "fixed"
        slot_pages = max_rank_pages(shapes.module_shapes, config.max_lora_rank, page_elems)
        region = config.max_loras * slot_pages
        if region >= num_pages:
            raise ConfigError(
                f"a fixed adapter region of {config.max_loras} adapters at rank {config.max_lora_rank} needs "
                f"{region} pages and leaves none of the pool's {num_pages} for the KV cache: lower max_loras or "
                "max_lora_rank, or give the pool more memory"
            )
        kv_pool = PagePool(num_pages - region, range(num_pages - region))
        return cls(kv_pool, PagePool(region, range(num_pages - region, num_pages)), slot_pages)

    @property
    def unified(self) -> bool:
        return self.adapters is self.kv

    @property
    def adapter_region_pages(self) -> int:
        """Pages of the fixed adapter region (0 when unified)."""
        return 0 if self.unified else self.adapters.num_pages

    @property
    def num_pages(self) -> int:
        return self.kv.num_pages + self.adapter_region_pages

    def pages_by_kind(self) -> dict[PageKind, int]:
        """Pages of every kind, over both pools (they add up to ``num_pages``)."""
        counts = dict.fromkeys(PageKind, 0)
        for pool in self._pools():
            for kind, count in pool.num_pages_by_kind().items():
                counts[kind] += count
        return counts

    def evictions_by_kind(self) -> dict[PageKind, int]:
        """Pages reclaimed from idle contents so far, by kind, over both pools."""
        counts: dict[PageKind, int] = {}
        for pool in self._pools():
            for kind, count in pool.num_evictions.items():
                counts[kind] = counts.get(kind, 0) + count
        return counts

    def _pools(self) -> tuple[PagePool, ...]:
        return (self.kv,) if self.unified else (self.kv, self.adapters)
