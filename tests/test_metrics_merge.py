"""The Ray ingress's ``/metrics``: every replica's Prometheus exposition merged into one, each sample
labelled by replica (``merge_replica_metrics`` in ``entrypoints/fleet_metrics.py``; no Ray needed)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraserve.entrypoints.fleet_metrics import merge_replica_metrics

AWKWARD = 'a,b="c"\\n}{ d'  # a label value with a comma, quotes, a backslash-n and braces


def _exposition(loads: int, adapter: str = AWKWARD) -> str:
    """One replica's exposition, made by prometheus_client as the replica's API makes it."""
    registry = CollectorRegistry()
    Counter("loraserve_adapter_loads", "Adapter weight loads into the pool", registry=registry).inc(loads)
    tokens = Counter("loraserve_prompt_tokens", "Prompt tokens", ["model"], registry=registry)
    tokens.labels(adapter).inc(7)
    Gauge("loraserve_pool_pages", "Pages of the unified pool by use", ["kind"], registry=registry).labels("free").set(9)
    latency = Histogram("loraserve_e2e_request_latency_seconds", "Request latency", ["model"], buckets=(0.5, 2.0),
                        registry=registry)  # fmt: skip
    latency.labels(adapter).observe(1.0)
    return generate_latest(registry).decode()


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(text: str, name: str, **labels: Any) -> float:
    return _samples(text)[(name, frozenset(labels.items()))]


def test_every_sample_gets_its_replica_label_and_each_family_one_help_and_type() -> None:
    merged = merge_replica_metrics({"r1": _exposition(1), "r2": _exposition(4)})
    assert _value(merged, "loraserve_adapter_loads_total", replica="r1") == 1
    assert _value(merged, "loraserve_adapter_loads_total", replica="r2") == 4
    assert _value(merged, "loraserve_prompt_tokens_total", model=AWKWARD, replica="r2") == 7  # the label survived
    assert _value(merged, "loraserve_e2e_request_latency_seconds_bucket", model=AWKWARD, le="2.0", replica="r1") == 1
    assert _value(merged, "loraserve_replica_up", replica="r1") == _value(merged, "loraserve_replica_up", replica="r2")
    assert _value(merged, "loraserve_replica_up", replica="r1") == 1
    lines = merged.splitlines()
    for name in ("loraserve_adapter_loads_total", "loraserve_pool_pages", "loraserve_e2e_request_latency_seconds"):
        assert sum(line.startswith(f"# HELP {name} ") for line in lines) == 1, name
        assert sum(line.startswith(f"# TYPE {name} ") for line in lines) == 1, name
    samples = [line for line in lines if line and not line.startswith("#")]
    assert all('replica="' in line for line in samples)
    # a family's samples stay together (the text format requires it): r1's then r2's
    pages = [i for i, line in enumerate(lines) if line.startswith("loraserve_pool_pages{")]
    assert pages == list(range(pages[0], pages[0] + 2))
    # and everything else of each replica is there, unchanged
    for replica, text in (("r1", _exposition(1)), ("r2", _exposition(4))):
        for (name, labels), value in _samples(text).items():
            if not name.endswith("_created"):
                assert _samples(merged)[(name, labels | {("replica", replica)})] == value


def test_a_replica_that_did_not_answer_is_reported_down_not_failed() -> None:
    merged = merge_replica_metrics({"live": _exposition(2), "silent": None, "garbled": "this is { not prometheus"})
    assert _value(merged, "loraserve_replica_up", replica="live") == 1
    assert _value(merged, "loraserve_replica_up", replica="silent") == 0
    assert _value(merged, "loraserve_replica_up", replica="garbled") == 0
    assert _value(merged, "loraserve_adapter_loads_total", replica="live") == 2
    silent = [name for name, labels in _samples(merged) if ("replica", "silent") in labels]
    assert silent == ["loraserve_replica_up"]  # nothing else of it, and the scrape did not fail


def test_the_ingress_metrics_are_added_without_a_replica_label_and_a_replica_label_is_kept_aside() -> None:
    own = CollectorRegistry()
    Counter("loraserve_ingress_resent_requests", "Resent", registry=own).inc(3)
    clash = CollectorRegistry()
    Gauge("relabelled", "A replica label of its own", ["replica"], registry=clash).labels("inner").set(5)
    merged = merge_replica_metrics({"r1": generate_latest(clash).decode()}, own=generate_latest(own).decode())
    assert _value(merged, "loraserve_ingress_resent_requests_total") == 3
    assert _value(merged, "relabelled", exported_replica="inner", replica="r1") == 5
    assert merge_replica_metrics({}).strip().splitlines()[-1].startswith("# TYPE loraserve_replica_up gauge")
