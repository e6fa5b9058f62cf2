"""Turning what every Envoy process reports into one view per service and per backend (pure)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

from servekeeper.dataplane.admin import ClusterCounters, ProcessConfig, inflight
from servekeeper.dataplane.model import BackendStats, RouteObservation
from servekeeper.dataplane.names import FAILOVER, HTTP, backend_of
from servekeeper.model.routing import HeaderMatch, Mirror


def observe_routes(answers: Sequence[tuple[ProcessConfig, dict[str, ClusterCounters]]]) -> dict[str, RouteObservation]:
    per_process_weights: list[dict[str, dict[str, int]]] = []
    per_process_headers: list[dict[str, tuple[HeaderMatch, str]]] = []  # service -> (match, backend)
    per_process_mirrors: list[dict[str, Mirror]] = []
    busy: dict[str, int] = {}
    failing_over: set[str] = set()  # services whose route (in some process) has a standby behind it
    for config, stats in answers:
        weights: dict[str, dict[str, int]] = {}
        for name, clusters in config.route_weights.items():
            protocol, _, service = name.partition("-")
            if protocol == HTTP:
                owners = {cluster: owner for cluster in clusters if (owner := backend_of(cluster))}
                weights[service] = {owner[1]: clusters[cluster] for cluster, owner in owners.items()}
                if any(owner[0] == FAILOVER for owner in owners.values()):
                    failing_over.add(service)
        per_process_weights.append(weights)
        headers: dict[str, tuple[HeaderMatch, str]] = {}
        for name, (match, cluster) in config.route_headers.items():
            protocol, _, service = name.partition("-")
            owner = backend_of(cluster)
            if protocol == HTTP and owner is not None:
                headers[service] = (match, owner[1])
        per_process_headers.append(headers)
        mirrors: dict[str, Mirror] = {}
        for name, (cluster, percent, methods) in config.route_mirrors.items():
            protocol, _, service = name.partition("-")
            owner = backend_of(cluster)
            if protocol == HTTP and owner is not None:
                mirrors[service] = Mirror(owner[1], percent, methods)
        per_process_mirrors.append(mirrors)
        for backend, counters in stats.items():
            busy[backend] = busy.get(backend, 0) + inflight(counters)
    observed: dict[str, RouteObservation] = {}
    for service in sorted({s for weights in per_process_weights for s in weights}):
        seen = [weights.get(service) for weights in per_process_weights]
        merged: dict[str, int] = {}
        for one in seen:
            for backend, weight in (one or {}).items():
                merged[backend] = max(merged.get(backend, 0), weight)
        header_seen = [headers.get(service) for headers in per_process_headers]
        header = header_seen[0]
        mirror_seen = [mirrors.get(service) for mirrors in per_process_mirrors]
        observed[service] = RouteObservation(
            service=service,
            weights=merged,
            in_sync=all(one == seen[0] for one in seen)
            and all(one == header for one in header_seen)
            and all(one == mirror_seen[0] for one in mirror_seen),
            inflight={backend: busy.get(backend, 0) for backend in merged},
            failover=service in failing_over,
            header_route=header[0] if header is not None else None,
            header_backend=header[1] if header is not None else None,
            mirror=mirror_seen[0],
        )
    return observed


def sum_backend_stats(answers: Sequence[dict[str, ClusterCounters]]) -> dict[str, BackendStats]:
    """The request counters and latencies are the main clusters' alone (what a canary is judged
    on: the preview port's smoke tests are not user traffic); rq_active is the in-flight figure
    that routes() reports, preview requests included."""
    totals: dict[str, dict[str, int]] = {}
    buckets: dict[str, dict[float, int]] = {}
    failing_over: set[str] = set()
    for stats in answers:
        for backend, counters in stats.items():
            if not counters.values and not counters.latency_ms_buckets:
                continue  # only a preview cluster's stats (no main cluster in this process)
            into = totals.setdefault(backend, {})
            if counters.fails_over:
                failing_over.add(backend)
            for key in (
                "upstream_rq_total",
                "upstream_rq_completed",
                "upstream_rq_2xx",
                "upstream_rq_4xx",
                "upstream_rq_5xx",
            ):
                into[key] = into.get(key, 0) + counters.values.get(key, 0)
            into["active"] = into.get("active", 0) + inflight(counters)
            for bound, count in counters.latency_ms_buckets.items():
                buckets.setdefault(backend, {})[bound] = buckets.get(backend, {}).get(bound, 0) + count
    return {
        backend: BackendStats(
            backend=backend,
            rq_total=t["upstream_rq_total"],
            rq_2xx=t["upstream_rq_2xx"],
            rq_4xx=t["upstream_rq_4xx"],
            rq_5xx=t["upstream_rq_5xx"],
            rq_active=t["active"],
            rq_completed=t["upstream_rq_completed"],
            rq_failed_over=_failed_over(t) if backend in failing_over else 0,
            latency_ms_buckets=dict(sorted(buckets.get(backend, {}).items())),
        )
        for backend, t in sorted(totals.items())
    }


def _failed_over(totals: dict[str, int]) -> int:
    """Answers booked on a backend's failover cluster that its own nodes never took. A request in
    flight or retried is in rq_total first: the estimate errs low, and it falls as requests start
    (see `never_falling`)."""
    return max(0, totals["upstream_rq_completed"] - totals["upstream_rq_total"])


def never_falling(
    stats: dict[str, BackendStats], peaks: dict[str, tuple[str, int]], epoch: str
) -> dict[str, BackendStats]:
    """`stats` with each backend's rq_failed_over at its highest of this epoch, as a counter must
    be: an analysis reads a fall as restarted counters, and a rise after a fall as new failures.
    `peaks` (backend -> (epoch, highest)) is updated in place."""
    kept = {}
    for name, backend in stats.items():
        seen_epoch, seen = peaks.get(name, (epoch, 0))
        highest = max(backend.rq_failed_over, seen if seen_epoch == epoch else 0)
        peaks[name] = (epoch, highest)
        kept[name] = replace(backend, rq_failed_over=highest)
    for gone in set(peaks) - set(stats):  # a deleted backend's
        del peaks[gone]
    return kept


def version_acknowledged(applied: str | None, written: str | None, resources: Collection[str]) -> bool:
    """Envoy reports no version for an empty CDS or LDS file: then only the resources tell."""
    return applied == written or not resources
