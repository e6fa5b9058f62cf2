"""Envoy configuration as a pure function of the desired routes: no I/O, no clock.

Every service gets a listener on 127.0.0.1 whose routes come from RDS (a file of its own), so that
moving weights changes only the route file and never the listener: a listener change would drain
and close the clients' connections, an RDS change keeps them. Every backend gets an Envoy cluster
per protocol. Names: listener and route config "http-<service>" / "grpc-<service>", cluster
"http-<backend>" / "grpc-<backend>".

A service with a preview port gets one more HTTP listener, "preview-<service>", with a route file
of its own that sends everything to the preview backend (or answers 503 when there is none); since
its name does not start with "http-", nothing reads it as the service's weights. The preview port
has clusters of its own, "preview-<backend>" (the HTTP cluster under another name), so that smoke
tests never count in a backend's request counters and latencies, which decide a canary; they
count only in its in-flight figure. Every backend of such a service gets one, not just the
previewed backend: moving the preview then changes only the route file, and a preview cluster is
dropped only with its backend, which happens once that backend is idle, preview requests included.

A cluster name is "<kind>-<backend>" with a kind from CLUSTER_KINDS, none of which holds a "-":
the text before the first "-" is always the kind, so a backend named "preview-x" (cluster
"http-preview-x") never reads as the preview cluster of "x" ("preview-x").
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from servekeeper.dataplane.model import Backend, ServiceRoute
from servekeeper.model.endpoint import Endpoint

Resource = dict[str, Any]

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
HTTP_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

HTTP, GRPC = "http", "grpc"
PREVIEW = "preview"  # the preview port's listener and route config, and its clusters
# "failover-<backend>": an aggregate of the backend's HTTP cluster, then the standby's
FAILOVER = "failover"
CLUSTER_KINDS = (HTTP, GRPC, PREVIEW, FAILOVER)
HEALTH_PATH = "/-/healthz"  # what Ray Serve's HTTP proxy answers 200 on while it takes traffic
# Shorter than the keep-alive of Serve's proxy (uvicorn, 90 s), so Envoy is always the side that
# closes an idle upstream connection; otherwise a request can race the upstream's close and fail.
UPSTREAM_IDLE_TIMEOUT_S = 60
# Only failures where the backend cannot have started the work are retried (no duplicates).
RETRY_ON = "connect-failure,refused-stream,reset-before-request"
# Envoy's defaults (1024 requests, 3 concurrent retries) would cap long-lived streams and retries.
CIRCUIT_LIMIT = 1_000_000


def cluster_name(kind: str, backend: str) -> str:
    return f"{kind}-{backend}"


def backend_of(cluster: str) -> tuple[str, str] | None:
    """(kind, backend) of a cluster name this module made, else None."""
    kind, _, backend = cluster.partition("-")
    return (kind, backend) if kind in CLUSTER_KINDS and backend else None


def listener_name(protocol: str, service: str) -> str:
    return f"{protocol}-{service}"


def route_file(xds_dir: Path, protocol: str, service: str) -> Path:
    return xds_dir / "rds" / f"{listener_name(protocol, service)}.json"


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}s"


def _address(host: str, port: int) -> Resource:
    return {"socket_address": {"address": host, "port_value": port}}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _health_timing(endpoint_count: int) -> Resource:
    """How soon a silent endpoint is ejected. One endpoint (a one-node cluster): generous, since
    with no panic routing ejecting a busy cluster's only proxy (a slow /-/healthz on two loaded
    cores) is an outage, and a dead one is refused at connect and retried anyway. Several (a
    proxy per node of a multi-host cluster): a host cut off the network stays silent, so it is
    ejected after about 3 s while the other nodes carry the traffic."""
    if endpoint_count > 1:
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


def render_failover_cluster(backend: str, standby: str) -> Resource:
    """The backend's HTTP cluster first, the standby's when it has no healthy endpoint left."""
    return {
        "@type": CLUSTER_TYPE,
        "name": cluster_name(FAILOVER, backend),
        "connect_timeout": "1s",
        "lb_policy": "CLUSTER_PROVIDED",
        # The route's retries count against this cluster's breaker: Envoy's default (3 retries at
        # once) would let the refused requests of more than 3 clients fail without their retry.
        "circuit_breakers": _circuit_breakers(),
        "cluster_type": {
            "name": "envoy.clusters.aggregate",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.clusters.aggregate.v3.ClusterConfig",
                "clusters": [cluster_name(HTTP, backend), cluster_name(HTTP, standby)],
            },
        },
    }


def render_cluster(kind: str, backend: Backend, fails_over: bool = False) -> Resource:
    """The backend's HTTP or gRPC cluster; a PREVIEW cluster is its HTTP cluster under another name.
    `fails_over`: a standby stands behind its HTTP cluster (see `_outlier_detection`)."""
    endpoints: tuple[Endpoint, ...] = backend.grpc if kind == GRPC else backend.http
    name = cluster_name(kind, backend.name)
    if kind != GRPC:
        health_check: Resource = {"http_health_check": {"path": HEALTH_PATH}}
        upstream_protocol: Resource = {"http_protocol_options": {}}
    else:
        # Serve's gRPC proxy has no standard health service: a connect check ejects a dead node.
        health_check = {"tcp_health_check": {}}
        upstream_protocol = {"http2_protocol_options": {}}
    extra: Resource = {"outlier_detection": _outlier_detection()} if fails_over and kind == HTTP else {}
    return {
        "@type": CLUSTER_TYPE,
        "name": name,
        **extra,
        "type": "STATIC" if all(_is_ip(e.host) for e in endpoints) else "STRICT_DNS",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",  # a retry then goes to the next host for sure
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(e.host, e.port)}} for e in endpoints]}],
        },
        # 0: with no healthy endpoint, answer 503 at once instead of spraying requests at dead ones.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "health_checks": [
            {
                **_health_timing(len(endpoints)),
                "interval": "1s",
                # Without this a cluster carrying no traffic (a draining one) is checked once a minute.
                "no_traffic_interval": "1s",
                "healthy_threshold": 1,
                **health_check,
            }
        ],
        # A host cut off the network does not refuse: requests sent on a pooled connection to it
        # would hang until the client gives up. Once ejected, its connections are closed.
        "close_connections_on_host_health_failure": len(endpoints) > 1,
        "circuit_breakers": _circuit_breakers(),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": HTTP_OPTIONS_TYPE,
                "common_http_protocol_options": {"idle_timeout": _duration(UPSTREAM_IDLE_TIMEOUT_S)},
                "explicit_http_config": upstream_protocol,
            }
        },
    }


def render_clusters(routes: Iterable[ServiceRoute]) -> dict[str, Resource]:
    clusters: dict[str, Resource] = {}
    for route in routes:
        for backend in route.backends:
            fails_over = route.standby is not None and backend.name != route.standby
            clusters[cluster_name(HTTP, backend.name)] = render_cluster(HTTP, backend, fails_over)
            if fails_over:
                assert route.standby is not None
                clusters[cluster_name(FAILOVER, backend.name)] = render_failover_cluster(backend.name, route.standby)
            if route.grpc_port is not None and backend.grpc:
                clusters[cluster_name(GRPC, backend.name)] = render_cluster(GRPC, backend)
            if route.preview_port is not None:
                clusters[cluster_name(PREVIEW, backend.name)] = render_cluster(PREVIEW, backend)
    return dict(sorted(clusters.items()))


def union_clusters(current: Mapping[str, Resource], new: Mapping[str, Resource]) -> dict[str, Resource]:
    """Make before break: the new clusters beside every cluster a route may still point at."""
    return dict(sorted({**current, **new}.items()))


def _route_config(name: str, service: str, entry: Resource) -> Resource:
    return {
        "@type": ROUTE_TYPE,
        "name": name,
        "virtual_hosts": [{"name": service, "domains": ["*"], "routes": [entry]}],
    }


def _forward(target: Resource, route: ServiceRoute, failover: bool = False) -> Resource:
    """Every path to `target` (a cluster or weighted clusters), with the service's timeout and retries.
    `failover`: the retry of a refused request goes to the next priority of a failover cluster (the
    standby) even before the refusing endpoint is seen as ejected on the worker thread serving it."""
    retries: Resource = {"num_retries": 1}
    if failover:
        # A second try: when the refusal raced the ejection on another worker thread, the first
        # retry can still land on the refusing endpoint; by the second (after a back-off) it cannot.
        retries["num_retries"] = 2
        retries["retry_priority"] = {
            "name": "envoy.retry_priorities.previous_priorities",
            "typed_config": {
                "@type": "type.googleapis.com/"
                "envoy.extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig",
                "update_frequency": 1,
            },
        }
    return {
        "match": {"prefix": "/"},
        "route": {
            **target,
            # Envoy's default is 15 s; 0 s turns the limit off so long streams live.
            "timeout": _duration(route.request_timeout_s),
            "retry_policy": {
                **retries,
                "retry_on": RETRY_ON,
                "retry_host_predicate": [
                    {
                        "name": "envoy.retry_host_predicates.previous_hosts",
                        "typed_config": {
                            "@type": "type.googleapis.com/"
                            "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                        },
                    }
                ],
                "host_selection_retry_max_attempts": 5,
            },
        },
    }


def render_route_config(protocol: str, route: ServiceRoute) -> Resource:
    def target(backend: str) -> str:
        if protocol == HTTP and route.standby is not None and backend != route.standby:
            return cluster_name(FAILOVER, backend)
        return cluster_name(protocol, backend)

    weighted = [
        {"name": target(backend.name), "weight": route.weights[backend.name]}
        for backend in route.backends
        if protocol == HTTP or backend.grpc
    ]
    failover = protocol == HTTP and route.standby is not None
    entry = _forward({"weighted_clusters": {"clusters": weighted}}, route, failover)
    return _route_config(listener_name(protocol, route.service), route.service, entry)


def no_preview_body(service: str) -> str:
    return f"no preview: service {service} has no pending cluster\n"


def render_preview_route_config(route: ServiceRoute) -> Resource:
    """All of the preview port's requests to the preview backend, whatever the weights; without
    one, a 503 that says so (rather than a refused connection, which looks like an outage)."""
    if route.preview_backend is not None:
        entry = _forward({"cluster": cluster_name(PREVIEW, route.preview_backend)}, route)
    else:
        entry = {
            "match": {"prefix": "/"},
            # Envoy sends a local reply's body as text/plain.
            "direct_response": {"status": 503, "body": {"inline_string": no_preview_body(route.service)}},
        }
    return _route_config(listener_name(PREVIEW, route.service), route.service, entry)


def render_route_configs(routes: Iterable[ServiceRoute]) -> dict[str, Resource]:
    configs: dict[str, Resource] = {}
    for route in routes:
        configs[listener_name(HTTP, route.service)] = render_route_config(HTTP, route)
        if route.grpc_port is not None:
            configs[listener_name(GRPC, route.service)] = render_route_config(GRPC, route)
        if route.preview_port is not None:
            configs[listener_name(PREVIEW, route.service)] = render_preview_route_config(route)
    return dict(sorted(configs.items()))


def _router() -> Resource:
    return {
        "name": "envoy.filters.http.router",
        # No x-envoy-* headers towards clients or backends: the proxy stays invisible.
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
            "suppress_envoy_headers": True,
        },
    }


def render_listener(protocol: str, route: ServiceRoute, xds_dir: Path) -> Resource:
    name = listener_name(protocol, route.service)
    port = {HTTP: route.port, GRPC: route.grpc_port, PREVIEW: route.preview_port}[protocol]
    assert port is not None
    idle = _duration(route.idle_timeout_s)
    manager: Resource = {
        "@type": HCM_TYPE,
        "stat_prefix": name,
        "codec_type": "AUTO",  # HTTP/1.x and h2c with prior knowledge on one port
        "rds": {
            "route_config_name": name,
            "config_source": {
                "resource_api_version": "V3",
                "path_config_source": {"path": str(route_file(xds_dir, protocol, route.service))},
            },
        },
        "use_remote_address": True,  # sets X-Forwarded-For / X-Forwarded-Proto from the real peer
        "generate_request_id": True,
        "server_header_transformation": "PASS_THROUGH",
        "stream_idle_timeout": idle,
        "common_http_protocol_options": {"idle_timeout": idle},
    }
    if protocol != GRPC:  # the preview listener is an HTTP listener like the main one, limits and all
        manager["http_protocol_options"] = {"accept_http_10": True, "default_host_for_http_10": route.service}
        # The buffer filter answers 413 past the limit, chunked bodies included. gRPC streams must
        # never be buffered, and an upgrade has no end of body to wait for: both skip it.
        manager["http_filters"] = [
            {
                "name": "envoy.filters.http.buffer",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                    "max_request_bytes": route.max_request_bytes,
                },
            },
            _router(),
        ]
        manager["upgrade_configs"] = [{"upgrade_type": "websocket", "filters": [_router()]}]
    else:
        manager["http_filters"] = [_router()]
    return {
        "@type": LISTENER_TYPE,
        "name": name,
        "address": _address("127.0.0.1", port),
        # Every Envoy process binds the same port; the kernel spreads new connections over them.
        "enable_reuse_port": True,
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }


def render_listeners(routes: Iterable[ServiceRoute], xds_dir: Path) -> dict[str, Resource]:
    listeners: dict[str, Resource] = {}
    for route in routes:
        listeners[listener_name(HTTP, route.service)] = render_listener(HTTP, route, xds_dir)
        if route.grpc_port is not None:
            listeners[listener_name(GRPC, route.service)] = render_listener(GRPC, route, xds_dir)
        if route.preview_port is not None:
            listeners[listener_name(PREVIEW, route.service)] = render_listener(PREVIEW, route, xds_dir)
    return dict(sorted(listeners.items()))


def discovery_response(version: str, resources: Iterable[Resource]) -> Resource:
    return {"version_info": version, "resources": list(resources)}


def render_bootstrap(node_id: str, admin_port: int, xds_dir: Path) -> Resource:
    def source(kind: str) -> Resource:
        return {"resource_api_version": "V3", "path_config_source": {"path": str(xds_dir / f"{kind}.json")}}

    return {
        "node": {"id": node_id, "cluster": "servekeeper"},
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "dynamic_resources": {"lds_config": source("lds"), "cds_config": source("cds")},
        # Histograms are merged for the admin interface at each flush; 1 s keeps latency figures fresh.
        "stats_flush_interval": "1s",
    }
