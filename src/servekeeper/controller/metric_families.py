"""The metric families of one scrape of the current state (controller/metrics.py fills them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric


@dataclass(frozen=True)
class StateFamilies:
    """The metric families of one scrape of the current state, filled service by service."""

    condition: GaugeMetricFamily
    generation: GaugeMetricFamily
    observed: GaugeMetricFamily
    traffic: GaugeMetricFamily
    inflight: GaugeMetricFamily
    requests: CounterMetricFamily
    latency: HistogramMetricFamily
    restarts: CounterMetricFamily
    dataplane_up: GaugeMetricFamily
    standby_ready: GaugeMetricFamily
    group_nodes: GaugeMetricFamily

    @classmethod
    def create(cls) -> StateFamilies:
        return cls(
            condition=GaugeMetricFamily(
                "servekeeper_service_condition", "1 if the condition is True, else 0.", labels=["service", "type"]
            ),
            generation=GaugeMetricFamily(
                "servekeeper_service_generation", "The latest applied generation.", labels=["service"]
            ),
            observed=GaugeMetricFamily(
                "servekeeper_service_observed_generation",
                "The generation rolled out (or failed) last.",
                labels=["service"],
            ),
            traffic=GaugeMetricFamily(
                "servekeeper_cluster_traffic_ratio",
                "Share of the service's traffic the ingress sends to the cluster (0 to 1), as every Envoy "
                "acknowledged.",
                labels=["service", "cluster", "role"],
            ),
            inflight=GaugeMetricFamily(
                "servekeeper_cluster_inflight_requests",
                "Requests and open streams in flight through the ingress to the cluster.",
                labels=["service", "cluster"],
            ),
            requests=CounterMetricFamily(
                "servekeeper_ingress_requests",
                "Requests the ingress sent to the cluster, by answer class (summed over the Envoy processes; "
                "a restarted process starts again at 0).",
                labels=["service", "cluster", "code_class"],
            ),
            latency=HistogramMetricFamily(
                "servekeeper_ingress_request_duration_seconds",
                "Upstream request time seen by the ingress, per cluster (Envoy's upstream_rq_time).",
                labels=["service", "cluster"],
            ),
            restarts=CounterMetricFamily(
                "servekeeper_node_restarts",
                "Nodes of the cluster started again in place after their process exited (a head: with GCS "
                "fault tolerance), by role; failed tries of a start count too.",
                labels=["service", "cluster", "role"],
            ),
            dataplane_up=GaugeMetricFamily(
                "servekeeper_dataplane_stats_up", "1 if every Envoy process answered the stats read of this scrape."
            ),
            group_nodes=GaugeMetricFamily(
                "servekeeper_worker_group_nodes",
                "Nodes of each worker group: running, desired (asked for: running or starting), and its min "
                "and max (Ray's autoscaler moves desired between them; the fixed count without it).",
                labels=["service", "cluster", "group", "state"],
            ),
            standby_ready=GaugeMetricFamily(
                "servekeeper_standby_ready",
                "1 while the service's hot standby is ready for the ingress to fail over to (services with "
                "spec.standby only); its time at 0 is the time without a ready standby.",
                labels=["service"],
            ),
        )

    def all(self) -> tuple[Metric, ...]:
        return (
            self.condition,
            self.generation,
            self.observed,
            self.traffic,
            self.inflight,
            self.requests,
            self.latency,
            self.restarts,
            self.dataplane_up,
            self.standby_ready,
            self.group_nodes,
        )


def seconds_buckets(cumulative_ms: Mapping[float, int]) -> list[tuple[str, float]]:
    """Envoy's cumulative buckets (upper bounds in ms) as Prometheus `le` buckets in seconds. Envoy
    has no +Inf bucket; its largest bound (an hour) stands for it."""
    if not cumulative_ms:
        return []
    ordered = sorted(cumulative_ms.items())
    buckets = [(_le(bound / 1000.0), float(count)) for bound, count in ordered]
    buckets.append(("+Inf", float(ordered[-1][1])))
    return buckets


def _le(seconds: float) -> str:
    return repr(float(f"{seconds:.6g}"))  # "0.5", "10.0", as prometheus_client writes bounds
