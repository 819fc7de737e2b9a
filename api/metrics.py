"""Prometheus metrics of one server: request statistics plus a scrape-time engine snapshot.

Each app gets its own :class:`prometheus_client.CollectorRegistry`, so several servers in one
process (tests) never share or clash. Request statistics are recorded on the engine thread
through the :class:`~loraserve.api.async_engine.EngineObserver` hooks; engine state (pages,
queues, preemptions, evictions) is read on the engine thread at scrape time by
:func:`snapshot_engine` and exposed by :class:`EngineSnapshotCollector`.

Exposed names (``model`` is the base model id or the adapter name):

* ``loraserve_pool_pages{kind}``: pages by use: ``total``, ``free``, ``kv``, ``adapter``,
  ``prefix_cache`` (and any other kind the pool reports). ``total`` is the pool size; the
  other kinds add up to it.
* ``loraserve_requests_running``, ``loraserve_requests_waiting``, ``loraserve_requests_swapped``
* ``loraserve_preemptions_total``, ``loraserve_pool_evictions_total{kind}`` (``kind="prefix_cache"``:
  idle cached KV blocks reclaimed; ``adapter``: idle adapters),
  ``loraserve_adapter_loads_total``, ``loraserve_adapter_evictions_total``,
  ``loraserve_adapters_registered``, ``loraserve_engine_step_errors_total``
* ``loraserve_cpu_gemm_kernel{shape,rows,kernel}``: 1 for the GEMM kernel each linear layer shape runs
  on at each row bucket (``models/gemm_choice.py``; none when the linear layers are not packed)
* ``loraserve_prompt_tokens_total{model}``, ``loraserve_generation_tokens_total{model}``,
  ``loraserve_prefix_cache_hits_total{model}`` (requests that reused cached prompt tokens),
  ``loraserve_prefix_cache_hit_tokens_total{model}``, ``loraserve_request_success_total{model,finish_reason}``
* engine-wide prefix cache: ``loraserve_prefix_cache_enabled`` (0/1), ``loraserve_prefix_cache_hit_rate``
  (matched / queried prompt tokens since start), ``loraserve_prefix_cache_queried_tokens_total`` and
  ``loraserve_prefix_cache_matched_tokens_total`` (lookups at admission, counted again when a preempted
  sequence is re-admitted), ``loraserve_prefix_cache_blocks`` (blocks registered, in use or idle; the
  idle ones are ``loraserve_pool_pages{kind="prefix_cache"}``)
* histograms ``loraserve_time_to_first_token_seconds{model}``,
  ``loraserve_inter_token_latency_seconds{model}``, ``loraserve_e2e_request_latency_seconds{model}``
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraserve.llm_engine import LLMEngine
from loraserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0, 120.0, 300.0)


@dataclass
class EngineSnapshot:
    """Engine state at one moment, read on the engine thread."""

    num_pages: int
    pages_by_kind: dict[str, int]
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    evictions_by_kind: dict[str, int]
    num_adapter_loads: int
    num_adapter_evictions: int
    num_adapters: int
    prefix_cache_enabled: bool = False
    prefix_cache_queried_tokens: int = 0
    prefix_cache_matched_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_blocks: int = 0
    cpu_gemm: dict[str, dict[str, str]] = field(default_factory=dict)  # layer shape -> bucket rows -> kernel


def snapshot_engine(engine: LLMEngine) -> EngineSnapshot:
    """Read the engine's counters; must run on the engine thread (``AsyncEngine.call``)."""
    scheduler = engine.scheduler
    evictions = dict(engine.pool.num_evictions)
    manager = getattr(engine, "adapters", None)  # the engine's AdapterManager, when it has one
    registry = getattr(engine, "adapter_registry", None)
    index = getattr(getattr(engine, "kv_manager", None), "prefix_cache", None)  # None when disabled
    return EngineSnapshot(
        num_pages=engine.pool.num_pages,
        pages_by_kind=dict(engine.pool.num_pages_by_kind()),
        num_running=len(scheduler.running),
        num_waiting=scheduler.num_waiting,  # waiting for an adapter included
        num_swapped=len(getattr(scheduler, "swapped", ())),
        num_preemptions=int(scheduler.num_preemptions),
        evictions_by_kind=evictions,
        num_adapter_loads=int(getattr(manager, "num_loads", 0)),
        num_adapter_evictions=int(getattr(manager, "num_evictions", evictions.get("adapter", 0))),
        num_adapters=len(registry.names()) if registry is not None else 0,
        prefix_cache_enabled=index is not None,
        prefix_cache_queried_tokens=int(index.num_queried_tokens) if index is not None else 0,
        prefix_cache_matched_tokens=int(index.num_hit_tokens) if index is not None else 0,
        prefix_cache_hit_rate=float(index.hit_rate) if index is not None else 0.0,
        prefix_cache_blocks=len(index) if index is not None else 0,
        cpu_gemm=engine.gemm_plan.as_dict()["layers"] if hasattr(engine, "gemm_plan") else {},
    )


class EngineSnapshotCollector(Collector):
    """Exposes the last :class:`EngineSnapshot` (set just before each scrape)."""

    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None
        self.num_step_errors = 0

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        pages = GaugeMetricFamily("loraserve_pool_pages", "Pages of the unified pool by use", labels=["kind"])
        pages.add_metric(["total"], snap.num_pages)
        for kind in ("free", "kv", "adapter", "prefix_cache"):
            pages.add_metric([kind], snap.pages_by_kind.get(kind, 0))
        for kind, count in sorted(snap.pages_by_kind.items()):
            if kind not in ("total", "free", "kv", "adapter", "prefix_cache"):
                pages.add_metric([kind], count)
        yield pages
        yield GaugeMetricFamily("loraserve_requests_running", "Sequences running", value=snap.num_running)
        yield GaugeMetricFamily("loraserve_requests_waiting", "Sequences waiting", value=snap.num_waiting)
        yield GaugeMetricFamily("loraserve_requests_swapped", "Sequences swapped out", value=snap.num_swapped)
        yield CounterMetricFamily("loraserve_preemptions", "Sequence preemptions", value=snap.num_preemptions)
        evictions = CounterMetricFamily("loraserve_pool_evictions", "Idle pool entries evicted", labels=["kind"])
        for kind, count in sorted({"adapter": 0, "prefix_cache": 0, **snap.evictions_by_kind}.items()):
            evictions.add_metric([kind], count)
        yield evictions
        yield from _prefix_cache_metrics(snap)
        yield CounterMetricFamily(
            "loraserve_adapter_loads", "Adapter weight loads into the pool", value=snap.num_adapter_loads
        )
        yield CounterMetricFamily(
            "loraserve_adapter_evictions",
            "Idle adapters evicted from the pool",
            value=snap.num_adapter_evictions,
        )
        yield GaugeMetricFamily("loraserve_adapters_registered", "Registered adapters", value=snap.num_adapters)
        yield CounterMetricFamily(
            "loraserve_engine_step_errors", "Engine steps that raised", value=self.num_step_errors
        )
        gemm = GaugeMetricFamily(
            "loraserve_cpu_gemm_kernel",
            "1 for the GEMM kernel that runs each linear layer shape at each row bucket (chosen by timing)",
            labels=["shape", "rows", "kernel"],
        )
        for shape, by_rows in sorted(snap.cpu_gemm.items()):
            for rows, kernel in by_rows.items():
                gemm.add_metric([shape, rows, kernel], 1)
        yield gemm


def _prefix_cache_metrics(snap: EngineSnapshot) -> Iterator[Metric]:
    """The engine-wide prefix cache statistics (zeros when prefix caching is disabled)."""
    yield GaugeMetricFamily(
        "loraserve_prefix_cache_enabled", "1 if automatic prefix caching is on", value=int(snap.prefix_cache_enabled)
    )
    yield GaugeMetricFamily(
        "loraserve_prefix_cache_hit_rate",
        "Prompt tokens found in the prefix cache / prompt tokens looked up, since start",
        value=snap.prefix_cache_hit_rate,
    )
    yield CounterMetricFamily(
        "loraserve_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache at admission",
        value=snap.prefix_cache_queried_tokens,
    )
    yield CounterMetricFamily(
        "loraserve_prefix_cache_matched_tokens",
        "Prompt tokens found in the prefix cache at admission",
        value=snap.prefix_cache_matched_tokens,
    )
    yield GaugeMetricFamily(
        "loraserve_prefix_cache_blocks", "KV blocks registered in the prefix cache", value=snap.prefix_cache_blocks
    )


@dataclass
class _RequestTiming:
    model: str
    arrival_time: float
    last_token_time: float = 0.0
    num_tokens_seen: list[int] = field(default_factory=list)


class ServerMetrics:
    """All metrics of one app; also the engine observer that records request statistics."""

    def __init__(self, base_model_id: str) -> None:
        self.base_model_id = base_model_id
        self.registry = CollectorRegistry()
        self.engine_collector = EngineSnapshotCollector()
        self.registry.register(self.engine_collector)
        r = self.registry
        self.prompt_tokens = Counter("loraserve_prompt_tokens", "Prompt tokens", ["model"], registry=r)
        self.generation_tokens = Counter("loraserve_generation_tokens", "Generated tokens", ["model"], registry=r)
        self.prefix_cache_hits = Counter(
            "loraserve_prefix_cache_hits", "Requests that reused cached prompt tokens", ["model"], registry=r
        )
        self.prefix_cache_hit_tokens = Counter(
            "loraserve_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", ["model"], registry=r
        )
        self.request_success = Counter(
            "loraserve_request_success", "Finished requests", ["model", "finish_reason"], registry=r
        )
        self.ttft = Histogram(
            "loraserve_time_to_first_token_seconds", "Time to first token", ["model"], buckets=_TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "loraserve_inter_token_latency_seconds", "Time between tokens", ["model"], buckets=_ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "loraserve_e2e_request_latency_seconds", "Request latency", ["model"], buckets=_E2E_BUCKETS, registry=r
        )
        self._timings: dict[str, _RequestTiming] = {}
        per_model = (self.prompt_tokens, self.generation_tokens, self.prefix_cache_hits, self.prefix_cache_hit_tokens)
        for counter in per_model:
            counter.labels(base_model_id)  # export the base model's series from the start

    def _model_label(self, adapter_name: str | None) -> str:
        return adapter_name or self.base_model_id

    # ---- EngineObserver (engine thread) --------------------------------------------------------
    def request_started(self, request_id: str, adapter_name: str | None, arrival_time: float) -> None:
        self._timings[request_id] = _RequestTiming(self._model_label(adapter_name), arrival_time)

    def request_output(self, output: RequestOutput, now: float) -> None:
        timing = self._timings.get(output.request_id)
        if timing is None:
            return
        counts = [len(completion.token_ids) for completion in output.outputs]
        if not timing.num_tokens_seen:
            timing.num_tokens_seen = [0] * len(counts)
        new_tokens = sum(counts) - sum(timing.num_tokens_seen)
        if new_tokens > 0:
            self.generation_tokens.labels(timing.model).inc(new_tokens)
        first_new = counts[0] - timing.num_tokens_seen[0]
        if first_new > 0:
            if timing.num_tokens_seen[0] == 0:
                self.ttft.labels(timing.model).observe(now - timing.arrival_time)
                self._record_prompt(output, timing.model)
            else:
                per_token = (now - timing.last_token_time) / first_new
                for _ in range(first_new):
                    self.itl.labels(timing.model).observe(per_token)
            timing.last_token_time = now
        timing.num_tokens_seen = counts
        if output.finished:
            self.request_success.labels(timing.model, output.outputs[0].finish_reason or "unknown").inc()
            self.e2e.labels(timing.model).observe(now - timing.arrival_time)

    def request_ended(self, request_id: str) -> None:
        self._timings.pop(request_id, None)

    def _record_prompt(self, output: RequestOutput, model: str) -> None:
        self.prompt_tokens.labels(model).inc(len(output.prompt_token_ids))
        if output.num_cached_tokens > 0:
            self.prefix_cache_hits.labels(model).inc()
            self.prefix_cache_hit_tokens.labels(model).inc(output.num_cached_tokens)
