"""The engine's state under vLLM's Prometheus names, for what reads vLLM's (LoRA-aware routers such
as the Gateway API inference extension, autoscaling rules, vLLM's dashboards), from the same
snapshot as ``loraserve_*`` (``metrics.py``). Labels as vLLM's: ``model_name`` (the base model
id) and ``engine`` (``"0"``: one engine per server).

* ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (requests whose adapter files are
  being read included)
* ``vllm:kv_cache_usage_perc``: the share of the pool held by running sequences' KV and pinned
  adapters, 0-1 (cached prefix blocks and idle adapters are evictable: free, as vLLM's cached blocks)
* ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}``: the scrape
  time, labelled with the adapters (comma-separated names) of the running and waiting requests;
  ``max_lora`` is the most adapters a step may hold: the fixed region's ``max_loras``, else
  ``max_num_seqs`` (the unified pool has no slot limit)
* ``vllm:num_preemptions_total``, ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``
  (prompt tokens looked up in the prefix cache at admission, and found)
* per request (:class:`VLLMRequestMetrics`, recorded with ``loraserve_*``'s; one series for the
  server, adapters' requests included, as vLLM's): ``vllm:prompt_tokens_total``,
  ``vllm:prompt_tokens_cached_total``, ``vllm:generation_tokens_total``,
  ``vllm:request_success_total{finished_reason}``, histograms ``vllm:time_to_first_token_seconds``,
  ``vllm:inter_token_latency_seconds``, ``vllm:request_time_per_output_token_seconds``,
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_prompt_tokens`` and
  ``vllm:request_generation_tokens``, on vLLM 0.32's buckets
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraserve.page_pool import PageKind
from loraserve.stats import EngineStats


class VLLMNamedCollector(Collector):
    """Reads the snapshot that ``snapshot()`` returns (the engine collector's, set before each scrape)."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineStats | None]) -> None:
        self.labels = [model_name, "0"]
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        if snap is None:
            return
        names = ["model_name", "engine"]
        for name, help_text, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", snap.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", snap.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", _usage(snap)),
        ):
            family = GaugeMetricFamily(name, help_text, labels=names)
            family.add_metric(self.labels, value)
            yield family
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        waiting, running = ",".join(snap.waiting_adapter_names), ",".join(snap.running_adapter_names)
        lora.add_metric([str(snap.max_adapters_per_step), waiting, running], time.time())
        yield lora
        for name, help_text, count in (
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", snap.num_preemptions),
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                snap.prefix_cache_queried_tokens,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                snap.prefix_cache_matched_tokens,
            ),
        ):
            counter = CounterMetricFamily(name, help_text, labels=names)
            counter.add_metric(self.labels, count)
            yield counter


def _usage(snap: EngineStats) -> float:
    held = snap.pages_by_kind[PageKind.KV] + snap.pages_by_kind[PageKind.ADAPTER]
    return held / snap.num_pages if snap.num_pages else 0.0


# vLLM 0.32's default buckets (vllm/v1/metrics/buckets.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's, all exported from the start


def token_buckets(max_model_len: int) -> list[float]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exponent += 1


class VLLMRequestMetrics:
    """vLLM's per-request series in ``registry``, labelled ``model_name`` and ``engine`` "0"."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        names, values = ["model_name", "engine"], (model_name, "0")

        def counter(name: str, help_text: str) -> Counter:
            return Counter(name, help_text, names, registry=registry).labels(*values)

        def histogram(name: str, help_text: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, help_text, names, buckets=buckets, registry=registry).labels(*values)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*names, "finished_reason"],
            registry=registry,
        )  # fmt: skip
        self.request_success = {reason: success.labels(*values, reason) for reason in FINISHED_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)  # fmt: skip
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS
        )
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )

    def finished(
        self, reasons: list[str], e2e_s: float, prompt_tokens: int, generation_tokens: list[int], decode_s: float
    ) -> None:
        """A finished request: each sample (``reasons[i]``, ``generation_tokens[i]``) counted as
        vLLM counts the ``n`` samples of a request, as a request each; the time per output token
        from the first sample's ``decode_s`` (its first token to its last; 0 with one token, vLLM's)."""
        for reason, tokens in zip(reasons, generation_tokens, strict=True):
            self.request_success[reason if reason in self.request_success else "error"].inc()
            self.e2e.observe(e2e_s)
            self.request_prompt_tokens.observe(prompt_tokens)
            self.request_generation_tokens.observe(tokens)
        first = generation_tokens[0]
        self.time_per_output_token.observe(decode_s / (first - 1) if first > 1 else 0.0)
