"""Envoy's names and shapes that servekeeper's configuration shares: resource types, the kinds
of cluster and how a cluster, listener or route file is named (see `render` for the scheme),
and small value helpers. No I/O."""

from __future__ import annotations

from pathlib import Path
from typing import Any

Resource = dict[str, Any]

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
HTTP_OPTIONS_TYPE = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

HTTP, GRPC = "http", "grpc"
PREVIEW = "preview"  # the preview port's listener and route config, and its clusters
# "failover-<backend>": an aggregate of the backend's HTTP cluster, then the standby's;
# "grpcfailover-<backend>": the same of their gRPC clusters
FAILOVER, GRPC_FAILOVER = "failover", "grpcfailover"
CLUSTER_KINDS = (HTTP, GRPC, PREVIEW, FAILOVER, GRPC_FAILOVER)
FAILOVER_KIND = {HTTP: FAILOVER, GRPC: GRPC_FAILOVER}  # a protocol's main cluster kind -> its failover kind
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


def duration(seconds: float) -> str:
    return f"{seconds:.3f}s"


def address(host: str, port: int) -> Resource:
    return {"socket_address": {"address": host, "port_value": port}}
