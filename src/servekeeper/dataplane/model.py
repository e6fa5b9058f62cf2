"""What the data plane is asked to do and what it reports: plain frozen values, no I/O."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from servekeeper.model.endpoint import Endpoint
from servekeeper.model.observation import IngressRouteObservation
from servekeeper.model.routing import HeaderMatch, Mirror

# Names end up inside Envoy cluster names and stat names ("cluster.<name>.upstream_rq_active"):
# a dot or colon there would make the stat names ambiguous, so only a safe alphabet is accepted.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,100}$")


class DataPlaneError(RuntimeError):
    """Anything the data plane could not do or could not read; the caller treats it as "busy"."""


def check_name(kind: str, name: str) -> None:
    if not _NAME.match(name):
        raise DataPlaneError(f"{kind} name {name!r} must match {_NAME.pattern}")


# The ingress's `silentUpstreamSeconds` unless a service sets it (see `clusters._user_timeout`).
SILENT_UPSTREAM_S = 4.0


@dataclass(frozen=True)
class Backend:
    """One Ray cluster: every node's Serve HTTP proxy (and gRPC proxy, when it has one)."""

    name: str
    http: tuple[Endpoint, ...]
    grpc: tuple[Endpoint, ...] = ()

    def __post_init__(self) -> None:
        check_name("backend", self.name)
        if not self.http:
            raise DataPlaneError(f"backend {self.name} has no HTTP endpoint")
        for endpoint in self.http + self.grpc:
            if not 0 < endpoint.port < 65536:
                raise DataPlaneError(f"backend {self.name}: endpoint port {endpoint.port} is out of range")


@dataclass(frozen=True)
class ServiceRoute:
    service: str
    port: int
    backends: tuple[Backend, ...]
    # Backend name -> weight. A draining backend stays listed with 0 so its in-flight count is read.
    weights: Mapping[str, int]
    grpc_port: int | None = None
    max_request_bytes: int = 64 * 1024 * 1024
    request_timeout_s: float = 0  # 0: no limit, so long streams are never cut
    idle_timeout_s: float = 300
    silent_upstream_s: float = SILENT_UPSTREAM_S  # TCP_USER_TIMEOUT of the upstream connections; 0: the kernel's
    # A second HTTP port that sends every request to one backend (a pending cluster, for smoke
    # tests before any user traffic moves), whatever its weight; with no backend it answers 503.
    preview_port: int | None = None
    preview_backend: str | None = None
    # A hot standby: a backend listed with weight 0 that takes the HTTP (and, when it has gRPC
    # endpoints, the gRPC) traffic of any other backend the moment that one refuses connections
    # (a dead head), without waiting for a tick.
    standby: str | None = None
    # Requests matching `header_route` go to `header_backend` (HTTP), whatever the weights.
    header_route: HeaderMatch | None = None
    header_backend: str | None = None
    mirror: Mirror | None = None  # a share of the HTTP requests copied to one backend, answers dropped

    def __post_init__(self) -> None:
        check_name("service", self.service)
        names = [backend.name for backend in self.backends]
        if len(set(names)) != len(names):
            raise DataPlaneError(f"service {self.service}: backend names repeat: {names}")
        if set(self.weights) != set(names):
            raise DataPlaneError(f"service {self.service}: weights {dict(self.weights)} do not name backends {names}")
        if any(weight < 0 for weight in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise DataPlaneError(f"service {self.service}: weights must be >= 0 with a positive sum")
        if self.grpc_port is not None:
            if self.grpc_port == self.port:
                raise DataPlaneError(f"service {self.service}: grpc_port equals port")
            missing = [b.name for b in self.backends if not b.grpc and self.weights[b.name] > 0]
            if missing:
                raise DataPlaneError(f"service {self.service}: backends {missing} carry traffic but have no gRPC")
        self._check_preview(names)
        if self.standby is not None and (self.standby not in names or self.weights[self.standby] != 0):
            raise DataPlaneError(f"service {self.service}: standby {self.standby} must be a backend with weight 0")
        if (self.header_route is None) != (self.header_backend is None) or (
            self.header_backend is not None and self.header_backend not in names
        ):
            raise DataPlaneError(f"service {self.service}: a header route needs one of the backends {names}")
        if self.mirror is not None and (self.mirror.backend not in names or not 0 < self.mirror.percent <= 100):
            raise DataPlaneError(f"service {self.service}: a mirror needs one of the backends {names} and 1-100%")
        if min(self.request_timeout_s, self.idle_timeout_s, self.silent_upstream_s) < 0 or self.max_request_bytes <= 0:
            raise DataPlaneError(f"service {self.service}: limits must be positive")

    def listener_ports(self) -> list[int]:
        """Every port Envoy binds for this service."""
        return [port for port in (self.port, self.grpc_port, self.preview_port) if port is not None]

    def _check_preview(self, names: list[str]) -> None:
        if self.preview_port is None:
            if self.preview_backend is not None:
                raise DataPlaneError(
                    f"service {self.service}: preview_backend {self.preview_backend} has no preview_port"
                )
            return
        if self.preview_port in (self.port, self.grpc_port):
            raise DataPlaneError(f"service {self.service}: preview_port {self.preview_port} equals port or grpc_port")
        if self.preview_backend is not None and self.preview_backend not in names:
            raise DataPlaneError(
                f"service {self.service}: preview_backend {self.preview_backend} is not one of the backends {names}"
            )


@dataclass(frozen=True)
class RouteObservation:
    """A service's route as every Envoy process acknowledged it."""

    service: str
    weights: dict[str, int]  # the weights in force; when processes disagree, the largest weight any one has
    in_sync: bool  # every process has the same route
    inflight: dict[str, int] = field(default_factory=dict)  # backend -> requests and open streams, all processes
    failover: bool = False  # a standby stands behind the route's backends
    header_route: HeaderMatch | None = None  # its requests go to `header_backend`
    header_backend: str | None = None
    mirror: Mirror | None = None

    @property
    def backends(self) -> frozenset[str]:
        return frozenset(self.weights)

    @property
    def active(self) -> str | None:
        """The backend with the largest weight (ties: by name, so the answer is stable)."""
        carrying = [(weight, name) for name, weight in self.weights.items() if weight > 0]
        return max(carrying)[1] if carrying else None

    def to_ingress(self) -> IngressRouteObservation:
        return IngressRouteObservation(
            active=self.active,
            upstreams=self.backends,
            inflight=dict(self.inflight),
            weights=dict(self.weights),
            failover=self.failover,
            header_route=self.header_route,
            header_backend=self.header_backend,
            mirror=self.mirror,
        )


@dataclass(frozen=True)
class BackendStats:
    """Counters summed over the Envoy processes (a restarted process starts its counters at 0)."""

    backend: str
    rq_total: int = 0
    rq_2xx: int = 0
    rq_4xx: int = 0
    rq_5xx: int = 0
    rq_active: int = 0
    # Requests with their answer or their error (Envoy charges it in the same call as the code
    # classes: a request in flight, or one its client gave up on, is not among them).
    rq_completed: int = 0
    # Upstream request time: cumulative counts per bucket upper bound in milliseconds.
    latency_ms_buckets: dict[float, int] = field(default_factory=dict)
    # Of a backend with a standby behind it, the requests routed to it that its nodes never took:
    # Envoy books the standby's answers to them (codes, latency) on the backend's failover
    # cluster, so they are in rq_completed and the code classes, but not in rq_total.
    rq_failed_over: int = 0
    # Which processes these sums come from (their pids): counters compare only within one epoch.
    epoch: str = ""


def route_to_json(route: ServiceRoute) -> dict[str, Any]:
    return {
        "service": route.service,
        "port": route.port,
        "grpc_port": route.grpc_port,
        "weights": dict(route.weights),
        "max_request_bytes": route.max_request_bytes,
        "request_timeout_s": route.request_timeout_s,
        "idle_timeout_s": route.idle_timeout_s,
        "silent_upstream_s": route.silent_upstream_s,
        "preview_port": route.preview_port,
        "preview_backend": route.preview_backend,
        "standby": route.standby,
        "header_route": (
            None
            if route.header_route is None
            else {
                "header": route.header_route.header,
                "value": route.header_route.value,
                "regex": route.header_route.regex,
            }
        ),
        "header_backend": route.header_backend,
        "mirror": dataclasses.asdict(route.mirror) if route.mirror is not None else None,
        "backends": [
            {
                "name": b.name,
                "http": [_endpoint_json(e) for e in b.http],
                "grpc": [_endpoint_json(e) for e in b.grpc],
            }
            for b in route.backends
        ],
    }


def _endpoint_json(endpoint: Endpoint) -> list[Any]:
    return [endpoint.host, endpoint.port, *([True] if endpoint.fallback else [])]


def _endpoint(data: list[Any]) -> Endpoint:
    """[host, port] or [host, port, true] (a fallback): routes stored before fallbacks read as before."""
    return Endpoint(data[0], data[1], len(data) > 2 and bool(data[2]))


def route_from_json(data: Mapping[str, Any]) -> ServiceRoute:
    try:
        backends = tuple(
            Backend(
                b["name"],
                tuple(_endpoint(e) for e in b["http"]),
                tuple(_endpoint(e) for e in b["grpc"]),
            )
            for b in data["backends"]
        )
        return ServiceRoute(
            service=data["service"],
            port=data["port"],
            backends=backends,
            weights=dict(data["weights"]),
            grpc_port=data["grpc_port"],
            max_request_bytes=data["max_request_bytes"],
            request_timeout_s=data["request_timeout_s"],
            idle_timeout_s=data["idle_timeout_s"],
            silent_upstream_s=data.get("silent_upstream_s", SILENT_UPSTREAM_S),  # routes stored before it was a setting
            # Routes stored before previews existed have neither key.
            preview_port=data.get("preview_port"),
            preview_backend=data.get("preview_backend"),
            standby=data.get("standby"),  # routes stored before standbys existed have none
            header_route=HeaderMatch(**header) if (header := data.get("header_route")) else None,
            header_backend=data.get("header_backend"),
            mirror=_mirror_from_json(data.get("mirror")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DataPlaneError(f"unreadable stored route: {exc!r}") from exc


def _mirror_from_json(data: Mapping[str, Any] | None) -> Mirror | None:
    if not data:
        return None
    return Mirror(data["backend"], int(data["percent"]), tuple(data["methods"]))
