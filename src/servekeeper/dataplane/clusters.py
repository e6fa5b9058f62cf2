"""Envoy clusters as a pure function of the desired routes: one per backend and protocol, with
health checks, breakers and (behind a standby) outlier detection and the failover aggregate."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping

from servekeeper.dataplane.model import Backend, ServiceRoute
from servekeeper.dataplane.names import (
    CIRCUIT_LIMIT,
    CLUSTER_TYPE,
    FAILOVER_KIND,
    GRPC,
    HEALTH_PATH,
    HTTP,
    HTTP_OPTIONS_TYPE,
    PREVIEW,
    UPSTREAM_IDLE_TIMEOUT_S,
    Resource,
    address,
    cluster_name,
    duration,
)
from servekeeper.model.endpoint import Endpoint


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# Seconds a pooled upstream connection is quiet before the kernel probes it: with 2 probes 1 s
# apart, an idle connection to a silent host fails about 4 s after its last byte (TCP_USER_TIMEOUT,
# when set, decides instead: the route's `silent_upstream_s`).
KEEPALIVE_TIME_S = 2


def _user_timeout(seconds: float) -> Resource:
    """setsockopt(IPPROTO_TCP, TCP_USER_TIMEOUT, ms) before connect (Linux: level 6, option 18):
    how long sent bytes may stay unacknowledged, or the peer's window shut, before the
    connection, and the request on it, fails. 0 leaves it to the kernel."""
    return {
        "description": "TCP_USER_TIMEOUT",
        "level": 6,
        "name": 18,
        "int_value": round(1000 * seconds),
        "state": "STATE_PREBIND",
    }


def _ejects_fast(endpoint_count: int, fails_over: bool) -> bool:
    """Whether a silent endpoint is ejected by health checks of 2 s, twice (5-6 s; a request to it
    that fails by the TCP timeouts below ejects it sooner): when other endpoints (a proxy per
    node of a multi-host cluster) or a standby carry the traffic meanwhile. A lone
    endpoint with nothing behind it is judged generously: with no panic routing, ejecting a busy
    cluster's only proxy (a slow /-/healthz on two loaded cores) is an outage, and a dead one is
    refused at connect and retried anyway."""
    return endpoint_count > 1 or fails_over


def _health_timing(fast: bool) -> Resource:
    if fast:
        return {"timeout": "2s", "unhealthy_threshold": 2}
    return {"timeout": "3s", "unhealthy_threshold": 3}


def _circuit_breakers() -> Resource:
    limits = ("max_connections", "max_pending_requests", "max_requests", "max_retries")
    return {"thresholds": [dict.fromkeys(limits, CIRCUIT_LIMIT)]}


def _outlier_detection() -> Resource:
    """For a backend with a standby behind it: the first refused connection ejects the endpoint,
    so the retry of that request and every request after it go to the standby at once (health
    checks alone take seconds). Only failures to connect count: an app's 5xx never fails over."""
    return {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 1,
        "enforcing_consecutive_local_origin_failure": 100,
        "enforcing_consecutive_5xx": 0,
        "enforcing_consecutive_gateway_failure": 0,
        "enforcing_success_rate": 0,
        "enforcing_local_origin_success_rate": 0,
        "interval": "1s",
        "base_ejection_time": "2s",
        "max_ejection_percent": 100,
    }


def render_failover_cluster(backend: str, standby: str, protocol: str = HTTP) -> Resource:
    """The backend's HTTP (or gRPC) cluster first, the standby's when it has no healthy endpoint left."""
    return {
        "@type": CLUSTER_TYPE,
        "name": cluster_name(FAILOVER_KIND[protocol], backend),
        "connect_timeout": "1s",
        "lb_policy": "CLUSTER_PROVIDED",
        # The route's retries count against this cluster's breaker: Envoy's default (3 retries at
        # once) would let the refused requests of more than 3 clients fail without their retry.
        "circuit_breakers": _circuit_breakers(),
        "cluster_type": {
            "name": "envoy.clusters.aggregate",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.clusters.aggregate.v3.ClusterConfig",
                "clusters": [cluster_name(protocol, backend), cluster_name(protocol, standby)],
            },
        },
    }


# A priority level takes all the traffic while any of its endpoints is healthy (Envoy's default,
# 140%, would spill a share of it to the next level as soon as one endpoint of the first is out).
ALL_TO_FIRST_HEALTHY_LEVEL = 1_000_000


def _load_assignment(name: str, endpoints: tuple[Endpoint, ...]) -> Resource:
    """The endpoints at priority 0, a fallback one (the head's proxy) at priority 1: it takes
    traffic only while no other proxy of the cluster is healthy."""
    levels = [[e for e in endpoints if not e.fallback], [e for e in endpoints if e.fallback]]
    if not levels[1]:
        levels = levels[:1]
    assignment: Resource = {
        "cluster_name": name,
        "endpoints": [
            {
                **({"priority": priority} if priority else {}),
                "lb_endpoints": [{"endpoint": {"address": address(e.host, e.port)}} for e in level],
            }
            for priority, level in enumerate(levels)
            if level
        ],
    }
    if len(levels) > 1:
        assignment["policy"] = {"overprovisioning_factor": ALL_TO_FIRST_HEALTHY_LEVEL}
    return assignment


def render_cluster(kind: str, backend: Backend, fails_over: bool, silent_upstream_s: float) -> Resource:
    """The backend's HTTP or gRPC cluster; a PREVIEW cluster is its HTTP cluster under another name.
    `fails_over`: a standby stands behind it (see `_outlier_detection`). `silent_upstream_s`: see
    `_user_timeout`."""
    endpoints: tuple[Endpoint, ...] = backend.grpc if kind == GRPC else backend.http
    name = cluster_name(kind, backend.name)
    if kind != GRPC:
        health_check: Resource = {"http_health_check": {"path": HEALTH_PATH}}
        upstream_protocol: Resource = {"http_protocol_options": {}}
    else:
        # Serve's gRPC proxy has no standard health service: a connect check ejects a dead node.
        health_check = {"tcp_health_check": {}}
        upstream_protocol = {"http2_protocol_options": {}}
    fails_over = fails_over and kind != PREVIEW
    extra: Resource = {"outlier_detection": _outlier_detection()} if fails_over else {}
    fast = _ejects_fast(len(endpoints), fails_over)
    return {
        "@type": CLUSTER_TYPE,
        "name": name,
        **extra,
        "type": "STATIC" if all(_is_ip(e.host) for e in endpoints) else "STRICT_DNS",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",  # a retry then goes to the next host for sure
        "load_assignment": _load_assignment(name, endpoints),
        # 0: with no healthy endpoint, answer 503 at once instead of spraying requests at dead ones.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "health_checks": [
            {
                **_health_timing(fast),
                "interval": "1s",
                # Without this a cluster carrying no traffic (a draining one) is checked once a minute.
                "no_traffic_interval": "1s",
                "healthy_threshold": 1,
                **health_check,
            }
        ],
        # A host cut off the network does not refuse: once it is ejected, no new request goes on
        # its pooled connections (Envoy drains them; it does not reset the requests on them).
        "close_connections_on_host_health_failure": fast,
        # A request hung on a silent host ends when the kernel finds its connection dead, not at
        # the client's timeout: a request not acknowledged within TCP_USER_TIMEOUT (one sent after
        # the host fell silent), one acknowledged when the keepalive probes go unanswered. A host
        # that answers, however slow its app, acknowledges both at once, so long requests live;
        # but an upload its app stops reading for longer shuts the window and fails the same way.
        "upstream_connection_options": {
            "tcp_keepalive": {"keepalive_time": KEEPALIVE_TIME_S, "keepalive_interval": 1, "keepalive_probes": 2}
        },
        "upstream_bind_config": {"socket_options": [_user_timeout(silent_upstream_s)]},
        "circuit_breakers": _circuit_breakers(),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": HTTP_OPTIONS_TYPE,
                "common_http_protocol_options": {"idle_timeout": duration(UPSTREAM_IDLE_TIMEOUT_S)},
                "explicit_http_config": upstream_protocol,
            }
        },
    }


def failover_target(route: ServiceRoute, backend: str, protocol: str) -> str | None:
    """The standby that takes `backend`'s traffic of `protocol` when it refuses connections: only
    for a backend that is not the standby, and for gRPC only when both speak it on a gRPC route."""
    if route.standby is None or backend == route.standby or protocol not in (HTTP, GRPC):
        return None
    if protocol == GRPC:
        speaks = {b.name for b in route.backends if b.grpc}
        if route.grpc_port is None or not {backend, route.standby} <= speaks:
            return None
    return route.standby


def render_clusters(routes: Iterable[ServiceRoute]) -> dict[str, Resource]:
    clusters: dict[str, Resource] = {}
    for route in routes:
        for backend in route.backends:
            fails_over = failover_target(route, backend.name, HTTP) is not None
            silent = route.silent_upstream_s
            clusters[cluster_name(HTTP, backend.name)] = render_cluster(HTTP, backend, fails_over, silent)
            if route.grpc_port is not None and backend.grpc:
                grpc_fails_over = failover_target(route, backend.name, GRPC) is not None
                clusters[cluster_name(GRPC, backend.name)] = render_cluster(GRPC, backend, grpc_fails_over, silent)
            for protocol in (HTTP, GRPC):
                if (standby := failover_target(route, backend.name, protocol)) is not None:
                    failover = render_failover_cluster(backend.name, standby, protocol)
                    clusters[cluster_name(FAILOVER_KIND[protocol], backend.name)] = failover
            if route.preview_port is not None:
                clusters[cluster_name(PREVIEW, backend.name)] = render_cluster(PREVIEW, backend, False, silent)
    return dict(sorted(clusters.items()))


def union_clusters(current: Mapping[str, Resource], new: Mapping[str, Resource]) -> dict[str, Resource]:
    """Make before break: the new clusters beside every cluster a route may still point at."""
    return dict(sorted({**current, **new}.items()))
