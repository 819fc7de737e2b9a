"""One typed snapshot of the engine's state, what ``/metrics`` and ``/health`` read."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraserve.page_pool import PageKind

if TYPE_CHECKING:
    from loraserve.llm_engine import LLMEngine
    from loraserve.sequence import Sequence


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
    cpu_decode_attention: dict[str, object] = field(default_factory=dict)  # DecodeAttentionPlan.as_dict(); ditto
    kernel_fallbacks: tuple[str, ...] = ()  # compiled kernels on a slower fallback (a library symbol missing)
    registry_up: bool = True  # the adapter registry answers and its changes are followed
    num_kv_tokens: int = 0  # tokens whose KV the running sequences hold (KV utilisation: / kv pages' slots)
    num_running_adapters: int = 0  # distinct adapters among the running sequences
    adapter_region_pages: int = 0  # pages of a fixed adapter region (adapter_region="fixed"); 0: unified
    adapter_decode_paths: dict[int, str] = field(default_factory=dict)  # padded size -> path measured faster
    running_adapter_names: tuple[str, ...] = ()  # adapters of the running sequences, sorted
    waiting_adapter_names: tuple[str, ...] = ()  # adapters of the waiting ones (their files' reads included)
    max_adapters_per_step: int = 0  # the fixed region's max_loras, else max_num_seqs (the unified pool's bound)

    @property
    def num_adapter_evictions(self) -> int:
        return self.evictions_by_kind[PageKind.ADAPTER_IDLE]


def engine_stats(engine: LLMEngine) -> EngineStats:
    """The snapshot of ``engine`` (``LLMEngine.stats()``): read from its managers and plans, on its thread."""
    index = engine.kv_manager.prefix_cache  # None when prefix caching is off
    scheduler, pools, adapters = engine.scheduler, engine.pools, engine.adapters
    running = scheduler.running
    return EngineStats(
        kernels=engine.kernels.name,
        num_pages=pools.num_pages,
        pages_by_kind=pools.pages_by_kind(),
        evictions_by_kind=pools.evictions_by_kind(),
        num_running=len(running),
        num_waiting=scheduler.num_waiting,
        num_swapped=len(scheduler.swapped),
        num_preemptions=scheduler.num_preemptions,
        num_adapter_loads=adapters.num_loads,
        num_adapters=adapters.resolver.num_registered,  # as the catalog last saw them: no registry call here
        registry_up=adapters.resolver.registry_up,
        prefix_cache_enabled=index is not None,
        prefix_cache_queried_tokens=index.num_queried_tokens if index is not None else 0,
        prefix_cache_matched_tokens=index.num_hit_tokens if index is not None else 0,
        prefix_cache_hit_rate=float(index.hit_rate) if index is not None else 0.0,
        prefix_cache_blocks=len(index) if index is not None else 0,
        cpu_gemm=engine.gemm_plan.as_dict() if engine.gemm_plan.choices else {},
        cpu_lora=engine.lora_plan.as_dict() if engine.lora_plan is not None else {},
        cpu_prefill_attention=engine.attention_plan.as_dict() if engine.attention_plan is not None else {},
        cpu_decode_attention=(
            engine.decode_attention_plan.as_dict() if engine.decode_attention_plan is not None else {}
        ),
        kernel_fallbacks=engine.kernel_fallbacks,
        num_kv_tokens=sum(seq.num_computed_tokens for seq in running),
        num_running_adapters=len({seq.adapter_id for seq in running if seq.adapter_id is not None}),
        adapter_region_pages=pools.adapter_region_pages,
        adapter_decode_paths={size: path.value for size, path in engine.runner.adapter_decode.chosen.items()},
        running_adapter_names=_adapter_names(running),
        waiting_adapter_names=_adapter_names([*scheduler.waiting, *scheduler.loading]),
        max_adapters_per_step=engine.config.max_loras or engine.config.max_num_seqs,
    )


def _adapter_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    return tuple(sorted({seq.adapter_name for seq in seqs if seq.adapter_name is not None}))
