"""Metrics of a fleet of engine replicas, as the Ray Serve ingress answers ``GET /metrics``: every
replica's own exposition merged into one, labelled by replica; and which replica actors are alive.
Ray is imported only inside the functions that need it, so the merge is testable without Ray.
"""

import asyncio
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

REPLICA_LABEL = "replica"


class _Families(Collector):
    """Metric families to render as they are (``generate_latest`` takes a registry of collectors)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_replica_metrics(replicas: Mapping[str, str | None], own: str = "") -> str:
    """One Prometheus text exposition of several replicas' expositions.

    ``replicas`` maps each replica id to its ``/metrics`` text, or None when it did not answer.
    Every sample gets the label ``replica="<id>"`` (a label of that name already there is kept as
    ``exported_replica``, as Prometheus does), each family keeps one HELP and TYPE (the first
    replica's) with all replicas' samples together, and ``loraserve_replica_up{replica}`` says
    which replicas answered (0 also for a text that does not parse). ``own`` (the ingress's
    metrics) is added without a replica label. Parsed and rendered by ``prometheus_client``, so
    label values with commas, quotes or newlines survive.
    """
    families: dict[str, Metric] = {}
    up = Metric("loraserve_replica_up", "1 if the engine replica answered the last scrape in time, 0 if not", "gauge")
    for replica in sorted(replicas):
        text = replicas[replica]
        try:
            parsed = list(text_string_to_metric_families(text)) if text is not None else None
        except ValueError as error:
            logger.warning("replica %s: unreadable /metrics: %s", replica, error)
            parsed = None
        up.add_sample(up.name, {REPLICA_LABEL: replica}, 0.0 if parsed is None else 1.0)
        for family in parsed or ():
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))  # fmt: skip
            for sample in family.samples:
                labels = dict(sample.labels)
                if REPLICA_LABEL in labels:
                    labels["exported_" + REPLICA_LABEL] = labels.pop(REPLICA_LABEL)
                labels[REPLICA_LABEL] = replica
                merged.samples.append(sample._replace(labels=labels))
    for family in text_string_to_metric_families(own):
        families.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
        families[family.name].samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*families.values(), up]))
    return generate_latest(registry).decode()


def replica_actor_name(app_name: str, deployment: str, unique_id: str) -> str:
    """The name of a Serve replica's Ray actor (namespace ``serve``), as Serve composes it."""
    from ray.serve._private.common import DeploymentID, ReplicaID

    return ReplicaID(unique_id, DeploymentID(name=deployment, app_name=app_name)).to_full_id_str()


def live_replica_ids(app_name: str, deployment: str) -> set[str]:
    """The replica ids whose actors are alive in the cluster (starting, serving or hung alike)."""
    import ray

    try:
        prefix = replica_actor_name(app_name, deployment, "")
        named = ray.util.list_named_actors(all_namespaces=True)
    except Exception as error:  # another Ray version: the silent replicas just go unreported
        logger.warning("cannot list the replica actors: %s", error)
        return set()
    return {entry["name"][len(prefix) :] for entry in named if entry["name"].startswith(prefix)}


async def each_answer(response: Any, timeout_s: float) -> list[Any]:
    """The answers to a ``DeploymentHandle.broadcast`` (an exception for a replica that raised) of the
    replicas that answered within ``timeout_s``, each waited for on its own: ``results_async`` has one
    deadline for all, so one late replica would cost every answer."""
    fetch = getattr(response, "_fetch_replica_results_async", None)
    if fetch is None:  # a Ray without it: one deadline for all
        try:
            return list(await response.results_async(timeout_s=timeout_s, return_exceptions=True))
        except TimeoutError:
            return []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        replica_results = await asyncio.wait_for(fetch(), timeout_s)
    except Exception as error:  # no replica running, or none reachable in time
        logger.warning("broadcast to the replicas failed: %r", error)
        return []
    tasks = [asyncio.ensure_future(result.get_async()) for result in replica_results]
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
    for task in pending:
        task.cancel()
    return [task.exception() if task.exception() is not None else task.result() for task in done]
