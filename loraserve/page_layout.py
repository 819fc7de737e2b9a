"""The shape of one page of the pool: one KV block of every layer, addressed by one page id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PageLayout:
    """Shape of a page; a page id addresses the same slot in every layer."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def page_elems(self) -> int:
        """Elements of one page in one layer (one KV block: K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    def page_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one page id across all layers."""
        return self.num_layers * self.page_elems * torch.tensor([], dtype=dtype).element_size()

    @classmethod
    def for_model(cls, config: Any, block_size: int) -> PageLayout:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, block_size, config.num_key_value_heads, head_dim)
