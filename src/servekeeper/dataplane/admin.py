"""Reading one Envoy process through its admin interface, and the pure parsers of its answers."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from servekeeper.dataplane.model import DataPlaneError
from servekeeper.dataplane.names import FAILOVER, GRPC_FAILOVER, PREVIEW, backend_of
from servekeeper.model.routing import HeaderMatch

ADMIN_TIMEOUT = aiohttp.ClientTimeout(total=3, sock_connect=1)
# Only cluster stats of ours; the histogram buckets come along for latency figures. A backend
# with a standby behind it has its answers (codes, upstream_rq_time) counted on its failover
# cluster, its requests and in-flight on its HTTP cluster (gRPC alike): each stat on one of
# them, so they add.
STATS_QUERY = "/stats?format=json&histogram_buckets=cumulative&filter=^cluster\\.(http|grpc|preview|(grpc)?failover)-"


@dataclass(frozen=True)
class ProcessConfig:
    """What one process has applied, from its /config_dump."""

    cds_version: str | None = None
    lds_version: str | None = None
    active_clusters: frozenset[str] = frozenset()
    warming_clusters: frozenset[str] = frozenset()
    active_listeners: frozenset[str] = frozenset()
    warming_listeners: frozenset[str] = frozenset()
    listener_errors: Mapping[str, str] = field(default_factory=dict)
    route_versions: Mapping[str, str] = field(default_factory=dict)  # route config name -> version
    route_weights: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # name -> cluster -> weight
    # route config name -> (its header route, the cluster it sends to); routes without one are absent
    route_headers: Mapping[str, tuple[HeaderMatch, str]] = field(default_factory=dict)
    # route config name -> (mirror cluster, percent, methods copied); routes without one are absent
    route_mirrors: Mapping[str, tuple[str, int, tuple[str, ...]]] = field(default_factory=dict)


def parse_config_dump(dump: Mapping[str, Any]) -> ProcessConfig:
    parsed: dict[str, Any] = {}
    for config in dump.get("configs", []):
        kind = config.get("@type", "").rsplit(".", 1)[-1]
        if kind == "ClustersConfigDump":
            parsed["cds_version"] = config.get("version_info")
            parsed["active_clusters"] = frozenset(
                c["cluster"]["name"] for c in config.get("dynamic_active_clusters", [])
            )
            parsed["warming_clusters"] = frozenset(
                c["cluster"]["name"] for c in config.get("dynamic_warming_clusters", [])
            )
        elif kind == "ListenersConfigDump":
            parsed["lds_version"] = config.get("version_info")
            listeners = config.get("dynamic_listeners", [])
            parsed["active_listeners"] = frozenset(x["name"] for x in listeners if "active_state" in x)
            parsed["warming_listeners"] = frozenset(x["name"] for x in listeners if "warming_state" in x)
            parsed["listener_errors"] = {
                x["name"]: str(x["error_state"].get("details", x["error_state"]))
                for x in listeners
                if "error_state" in x
            }
        elif kind == "RoutesConfigDump":
            versions, weights, headers, mirrors = {}, {}, {}, {}
            for dynamic in config.get("dynamic_route_configs", []):
                route_config = dynamic["route_config"]
                name = route_config["name"]
                versions[name] = dynamic.get("version_info", "")
                weights[name] = _weights(route_config)
                if (header := _header_route(route_config)) is not None:
                    headers[name] = header
                if (mirror := _mirror(route_config)) is not None:
                    mirrors[name] = mirror
            parsed.update(route_versions=versions, route_weights=weights, route_headers=headers, route_mirrors=mirrors)
    return ProcessConfig(**parsed)


def _weights(route_config: Mapping[str, Any]) -> dict[str, int]:
    weights: dict[str, int] = {}
    for host in route_config.get("virtual_hosts", []):
        for route in host.get("routes", []):
            for cluster in route.get("route", {}).get("weighted_clusters", {}).get("clusters", []):
                weights[cluster["name"]] = int(cluster.get("weight", 0))
    return weights


def _header_route(route_config: Mapping[str, Any]) -> tuple[HeaderMatch, str] | None:
    """The first route that matches on a header (the one servekeeper writes), and its cluster."""
    for host in route_config.get("virtual_hosts", []):
        for route in host.get("routes", []):
            headers = route.get("match", {}).get("headers", [])
            cluster = route.get("route", {}).get("cluster")
            if not headers or not cluster:
                continue
            string_match = headers[0].get("string_match", {})
            regex = string_match.get("safe_regex", {}).get("regex")
            value = regex if regex is not None else string_match.get("exact", "")
            return HeaderMatch(headers[0].get("name", ""), value, regex=regex is not None), cluster
    return None


def _mirror(route_config: Mapping[str, Any]) -> tuple[str, int, tuple[str, ...]] | None:
    """The route that copies requests (the one servekeeper writes): cluster, percent, methods."""
    for host in route_config.get("virtual_hosts", []):
        for route in host.get("routes", []):
            policies = route.get("route", {}).get("request_mirror_policies", [])
            if not policies:
                continue
            fraction = policies[0].get("runtime_fraction", {}).get("default_value", {})
            methods = next(
                (
                    h["string_match"]["safe_regex"]["regex"]
                    for h in route["match"].get("headers", [])
                    if h.get("name") == ":method"
                ),
                "",
            )
            return policies[0].get("cluster", ""), int(fraction.get("numerator", 0)), tuple(methods.split("|"))
    return None


@dataclass(frozen=True)
class ClusterCounters:
    """One backend's stats in one process: its HTTP and gRPC clusters added up, and apart from them
    its preview cluster's, which are smoke tests and count only as requests in flight."""

    values: Mapping[str, int]
    latency_ms_buckets: Mapping[float, int]
    preview_values: Mapping[str, int] = field(default_factory=dict)
    # Behind a failover (aggregate) cluster, which Envoy books the answers on: the standby's too.
    fails_over: bool = False


def parse_stats(stats: Mapping[str, Any]) -> dict[str, ClusterCounters]:
    """Per backend: the counters and gauges of its clusters, and their upstream_rq_time buckets;
    its preview cluster's counters and gauges kept apart, its histogram left out."""
    values: dict[str, dict[str, int]] = {}
    preview_values: dict[str, dict[str, int]] = {}
    buckets: dict[str, dict[float, int]] = {}
    failing_over: set[str] = set()
    for entry in stats.get("stats", []):
        if "value" in entry:
            _, _, rest = entry["name"].partition(".")
            cluster, _, stat = rest.partition(".")
            owner = backend_of(cluster)
            if owner is not None:
                kind, backend = owner
                if kind in (FAILOVER, GRPC_FAILOVER):
                    failing_over.add(backend)
                into = (preview_values if kind == PREVIEW else values).setdefault(backend, {})
                into[stat] = into.get(stat, 0) + int(entry["value"])
        for histogram in entry.get("histograms", []) if isinstance(entry.get("histograms"), list) else []:
            _, _, rest = histogram["name"].partition(".")
            cluster, _, stat = rest.partition(".")
            owner = backend_of(cluster)
            if owner is None or owner[0] == PREVIEW or stat != "upstream_rq_time":
                continue
            into_buckets = buckets.setdefault(owner[1], {})
            for bucket in histogram.get("buckets", []):
                bound = float(bucket["upper_bound"])
                into_buckets[bound] = into_buckets.get(bound, 0) + int(bucket.get("cumulative") or 0)
    names = set(values) | set(buckets) | set(preview_values)
    return {
        name: ClusterCounters(
            values.get(name, {}), buckets.get(name, {}), preview_values.get(name, {}), name in failing_over
        )
        for name in names
    }


def inflight(counters: ClusterCounters) -> int:
    """Requests a backend still owes an answer, the preview port's included: active ones, open
    upgraded streams (a WebSocket is an active request until it closes) and requests still waiting
    for a connection."""
    return sum(
        values.get("upstream_rq_active", 0) + values.get("upstream_rq_pending_active", 0)
        for values in (counters.values, counters.preview_values)
    )


class AdminClient:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    async def get(self, port: int, path: str) -> Any:
        url = f"http://127.0.0.1:{port}{path}"
        try:
            async with self._session.get(url, timeout=ADMIN_TIMEOUT) as response:
                if response.status != 200:
                    raise DataPlaneError(f"Envoy admin {url} answered {response.status}")
                if path.startswith(("/ready", "/server_info")) and "format=json" not in path:
                    return await response.text()
                return await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ValueError) as exc:
            raise DataPlaneError(f"Envoy admin {url} failed: {exc!r}") from exc

    async def config(self, port: int) -> ProcessConfig:
        return parse_config_dump(await self.get(port, "/config_dump"))

    async def stats(self, port: int) -> dict[str, ClusterCounters]:
        return parse_stats(await self.get(port, STATS_QUERY))

    async def ready(self, port: int) -> bool:
        try:
            return str(await self.get(port, "/ready")).strip() == "LIVE"
        except DataPlaneError:
            return False
