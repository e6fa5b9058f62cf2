"""Envoy's listeners, routes and bootstrap as a pure function of the desired routes: no I/O, no
clock (the clusters: `clusters`; names and shared shapes: `names`).

Every service gets a listener on 127.0.0.1 whose routes come from RDS (a file of its own), so that
moving weights changes only the route file and never the listener: a listener change would drain
and close the clients' connections, an RDS change keeps them. Every backend gets an Envoy cluster
per protocol. Names: listener and route config "http-<service>" / "grpc-<service>", cluster
"http-<backend>" / "grpc-<backend>"; behind a hot standby, the route points at "failover-<backend>"
/ "grpcfailover-<backend>", aggregates of the backend's cluster and then the standby's.

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

from collections.abc import Iterable
from pathlib import Path

from servekeeper.dataplane.clusters import failover_target
from servekeeper.dataplane.model import ServiceRoute
from servekeeper.dataplane.names import (
    FAILOVER_KIND,
    GRPC,
    HCM_TYPE,
    HTTP,
    LISTENER_TYPE,
    PREVIEW,
    RETRY_ON,
    ROUTE_TYPE,
    Resource,
    address,
    cluster_name,
    duration,
    listener_name,
    route_file,
)
from servekeeper.model.routing import HeaderMatch, Mirror


def _route_config(name: str, service: str, *entries: Resource) -> Resource:
    return {
        "@type": ROUTE_TYPE,
        "name": name,
        "virtual_hosts": [{"name": service, "domains": ["*"], "routes": list(entries)}],
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
            "timeout": duration(route.request_timeout_s),
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
        if failover_target(route, backend, protocol) is not None:
            return cluster_name(FAILOVER_KIND[protocol], backend)
        return cluster_name(protocol, backend)

    weighted = [
        {"name": target(backend.name), "weight": route.weights[backend.name]}
        for backend in route.backends
        if protocol == HTTP or backend.grpc
    ]
    failover = any(failover_target(route, backend.name, protocol) is not None for backend in route.backends)
    entries = [_forward({"weighted_clusters": {"clusters": weighted}}, route, failover)]
    if protocol == HTTP and route.mirror is not None:
        # The same weights for the copied methods, plus the copy; the other methods skip it.
        copied = _forward({"weighted_clusters": {"clusters": weighted}}, route, failover)
        # Not an upgrade: a WebSocket's copy would stay open on the canary, copying every frame.
        no_upgrade = {"name": "upgrade", "present_match": True, "invert_match": True}
        copied["match"]["headers"] = [method_matcher(route.mirror.methods), no_upgrade]
        copied["route"]["request_mirror_policies"] = [mirror_policy(route.mirror)]
        entries.insert(0, copied)
    if protocol == HTTP and route.header_route is not None and route.header_backend is not None:
        pinned = _forward({"cluster": cluster_name(HTTP, route.header_backend)}, route)
        pinned["match"]["headers"] = [header_matcher(route.header_route)]
        entries.insert(0, pinned)  # Envoy takes the first route that matches
    return _route_config(listener_name(protocol, route.service), route.service, *entries)


def method_matcher(methods: tuple[str, ...]) -> Resource:
    return {"name": ":method", "string_match": {"safe_regex": {"regex": "|".join(methods)}}}


def mirror_policy(mirror: Mirror) -> Resource:
    """Envoy's shadow: the copy goes out beside the request, its answer is dropped (and counted
    in the canary's cluster stats, which its analysis reads)."""
    fraction = {"numerator": mirror.percent, "denominator": "HUNDRED"}
    return {"cluster": cluster_name(HTTP, mirror.backend), "runtime_fraction": {"default_value": fraction}}


def header_matcher(match: HeaderMatch) -> Resource:
    """Envoy's HeaderMatcher: the whole value, exactly or by RE2 (Envoy's safe regex engine)."""
    string_match = {"safe_regex": {"regex": match.value}} if match.regex else {"exact": match.value}
    return {"name": match.header, "string_match": string_match}


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
    idle = duration(route.idle_timeout_s)
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
        "address": address("127.0.0.1", port),
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
        "admin": {"address": address("127.0.0.1", admin_port)},
        "dynamic_resources": {"lds_config": source("lds"), "cds_config": source("cds")},
        # Histograms are merged for the admin interface at each flush; 1 s keeps latency figures fresh.
        "stats_flush_interval": "1s",
    }
