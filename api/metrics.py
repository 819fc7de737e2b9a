"""Prometheus metrics of one server: request statistics plus a scrape-time engine snapshot.

Each app gets its own :class:`prometheus_client.CollectorRegistry`, so several servers in one
process (tests) never share or clash. Request statistics are recorded on the engine thread
through the :class:`~loraserve.api.async_engine.EngineObserver` hooks; engine state (pages,
queues, preemptions, evictions) is read on the engine thread at scrape time by
:meth:`LLMEngine.stats` and exposed by :class:`EngineSnapshotCollector`.

Exposed names (``model`` is the base model id or the adapter name):

* ``loraserve_pool_pages{kind}``: pages by use: ``total`` and every ``PageKind``: ``free``, ``kv``,
  ``adapter`` (pinned adapters), ``prefix_cache`` and ``adapter_idle`` (evictable idle contents).
  ``total`` is the pool size; the other kinds add up to it.
* ``loraserve_requests_running``, ``loraserve_requests_waiting``, ``loraserve_requests_swapped``
* ``loraserve_preemptions_total``, ``loraserve_pool_evictions_total{kind}`` (``kind="prefix_cache"``:
  idle cached KV blocks reclaimed; ``adapter_idle``: idle adapters),
  ``loraserve_adapter_loads_total``, ``loraserve_adapter_evictions_total``,
  ``loraserve_adapters_registered``, ``loraserve_engine_step_errors_total``
* ``loraserve_registry_up``: 1 while the adapter registry answers and this replica follows its
  changes, 0 during an outage (resident adapters are still served; the others answer 503)
* ``loraserve_cpu_gemm_kernel{shape,rows,kernel}``: 1 for the GEMM kernel each linear layer shape runs
  on at each row bucket (``models/gemm_choice.py``; none when the linear layers are not packed)
* ``loraserve_kernel_fallback{kernel}``: 1 when a compiled kernel runs its fallback (``lora_grouped_gemm``:
  a torch without MKL; long LoRA segments then run one ATen GEMM pair each)
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
  (TTFT and ITL from the engine's token times: a request not streamed counts as much as a streamed one)
* vLLM's names of the engine's state and of the requests' statistics, for what reads vLLM's
  (``vllm_metrics.py``)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraserve.outputs import RequestOutput
from loraserve.stats import EngineStats

from .vllm_metrics import VLLMNamedCollector, VLLMRequestMetrics

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0, 120.0, 300.0)


class EngineSnapshotCollector(Collector):
    """Exposes the last :class:`EngineStats` (set just before each scrape)."""

    def __init__(self) -> None:
        self.snapshot: EngineStats | None = None
        self.num_step_errors = 0

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        pages = GaugeMetricFamily("loraserve_pool_pages", "Pages of the unified pool by use", labels=["kind"])
        pages.add_metric(["total"], snap.num_pages)
        for kind, count in snap.pages_by_kind.items():
            pages.add_metric([kind.value], count)
        yield pages
        yield GaugeMetricFamily("loraserve_requests_running", "Sequences running", value=snap.num_running)
        yield GaugeMetricFamily("loraserve_requests_waiting", "Sequences waiting", value=snap.num_waiting)
        yield GaugeMetricFamily("loraserve_requests_swapped", "Sequences swapped out", value=snap.num_swapped)
        yield CounterMetricFamily("loraserve_preemptions", "Sequence preemptions", value=snap.num_preemptions)
        evictions = CounterMetricFamily("loraserve_pool_evictions", "Idle pool entries evicted", labels=["kind"])
        for kind, count in snap.evictions_by_kind.items():
            evictions.add_metric([kind.value], count)
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
        yield GaugeMetricFamily(
            "loraserve_registry_up", "1 while the adapter registry is reachable, 0 if not", value=int(snap.registry_up)
        )
        yield CounterMetricFamily(
            "loraserve_engine_step_errors", "Engine steps that raised", value=self.num_step_errors
        )
        gemm = GaugeMetricFamily(
            "loraserve_cpu_gemm_kernel",
            "1 for the GEMM kernel that runs each linear layer shape at each row bucket (chosen by timing)",
            labels=["shape", "rows", "kernel"],
        )
        layers: dict[str, dict[str, str]] = snap.cpu_gemm.get("layers", {})  # type: ignore[assignment]
        for shape, by_rows in sorted(layers.items()):
            for rows, kernel in by_rows.items():
                gemm.add_metric([shape, rows, kernel], 1)
        yield gemm
        fallback = GaugeMetricFamily(
            "loraserve_kernel_fallback",
            "1 for each compiled kernel running its slower fallback because a library symbol is missing",
            labels=["kernel"],
        )
        for name in ("lora_grouped_gemm",):
            fallback.add_metric([name], int(name in snap.kernel_fallbacks))
        yield fallback


def _prefix_cache_metrics(snap: EngineStats) -> Iterator[Metric]:
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

    def __init__(self, base_model_id: str, max_model_len: int) -> None:
        self.base_model_id = base_model_id
        self.registry = CollectorRegistry()
        self.engine_collector = EngineSnapshotCollector()
        self.registry.register(self.engine_collector)
        self.registry.register(VLLMNamedCollector(base_model_id, lambda: self.engine_collector.snapshot))
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
        self.vllm = VLLMRequestMetrics(r, base_model_id, max_model_len)
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
            self.vllm.generation_tokens.inc(new_tokens)
        first_new = counts[0] - timing.num_tokens_seen[0]
        if first_new > 0:
            # The engine's token times: a request not streamed reports once, at its end.
            latest = output.metrics.get("last_token_time", now)
            if timing.num_tokens_seen[0] == 0:
                first = output.metrics.get("first_token_time", now)
                self.ttft.labels(timing.model).observe(first - timing.arrival_time)
                self.vllm.ttft.observe(first - timing.arrival_time)
                self._record_prompt(output, timing.model)
                since, gaps = first, first_new - 1
            else:
                since, gaps = timing.last_token_time, first_new
            for _ in range(gaps):  # a report of several tokens: their mean gap, once per token
                self.itl.labels(timing.model).observe((latest - since) / gaps)
                self.vllm.itl.observe((latest - since) / gaps)
            timing.last_token_time = latest
        timing.num_tokens_seen = counts
        if output.finished:
            reason = output.outputs[0].finish_reason or "unknown"
            self.request_success.labels(timing.model, reason).inc()
            self.e2e.labels(timing.model).observe(now - timing.arrival_time)
            times = output.metrics
            decode_s = times.get("last_token_time", now) - times.get("first_token_time", now)
            reasons = [completion.finish_reason or "error" for completion in output.outputs]
            self.vllm.finished(reasons, now - timing.arrival_time, len(output.prompt_token_ids), counts, decode_s)

    def request_ended(self, request_id: str) -> None:
        self._timings.pop(request_id, None)

    def _record_prompt(self, output: RequestOutput, model: str) -> None:
        self.prompt_tokens.labels(model).inc(len(output.prompt_token_ids))
        self.vllm.prompt_tokens.inc(len(output.prompt_token_ids))
        self.vllm.prompt_tokens_cached.inc(output.num_cached_tokens)
        if output.num_cached_tokens > 0:
            self.prefix_cache_hits.labels(model).inc()
            self.prefix_cache_hit_tokens.labels(model).inc(output.num_cached_tokens)
