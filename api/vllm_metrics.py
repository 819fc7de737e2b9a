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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
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


def _usage(snap: EngineStats) -> float:
    held = snap.pages_by_kind[PageKind.KV] + snap.pages_by_kind[PageKind.ADAPTER]
    return held / snap.num_pages if snap.num_pages else 0.0
