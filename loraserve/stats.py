"""One typed snapshot of the engine's state, what ``/metrics`` and ``/health`` read."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.page_pool import PageKind


@dataclass(frozen=True)
class EngineStats:
    """Engine state at one moment (``LLMEngine.stats()``; read on the engine thread).

    ``pages_by_kind`` has every ``PageKind`` (they add up to ``num_pages``); ``evictions_by_kind``
    every evictable kind (``prefix_cache``: idle cached KV blocks reclaimed; ``adapter_idle``:
    idle adapters' pages reclaimed).
    """

    kernels: str
    num_pages: int
    pages_by_kind: dict[PageKind, int]
    evictions_by_kind: dict[PageKind, int]
    num_running: int
    num_waiting: int  # requests waiting for their adapter's files included
    num_swapped: int
    num_preemptions: int
    num_adapter_loads: int
    num_adapters: int  # registered, as this replica's catalog last saw them
    prefix_cache_enabled: bool = False
    prefix_cache_queried_tokens: int = 0
    prefix_cache_matched_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_blocks: int = 0
    cpu_gemm: dict[str, object] = field(default_factory=dict)  # GemmPlan.as_dict(); empty when not packed
    cpu_lora: dict[str, object] = field(default_factory=dict)  # LoRAKernelPlan.as_dict(); empty off the CPU kernel
    cpu_prefill_attention: dict[str, object] = field(default_factory=dict)  # PrefillAttentionPlan.as_dict(); ditto
    kernel_fallbacks: tuple[str, ...] = ()  # compiled kernels on a slower fallback (a library symbol missing)
    registry_up: bool = True  # the adapter registry answers and its changes are followed
    num_kv_tokens: int = 0  # tokens whose KV the running sequences hold (KV utilisation: / kv pages' slots)
    num_running_adapters: int = 0  # distinct adapters among the running sequences
    adapter_region_pages: int = 0  # pages of a fixed adapter region (adapter_region="fixed"); 0: unified
    adapter_decode_paths: dict[int, str] = field(default_factory=dict)  # padded size -> path measured faster

    @property
    def num_adapter_evictions(self) -> int:
        return self.evictions_by_kind[PageKind.ADAPTER_IDLE]
