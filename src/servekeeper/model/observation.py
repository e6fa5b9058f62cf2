"""What one look at the world showed: clusters, their apps and probes, the ingress route and its counters.

Frozen values built by the controller each tick and handed to the pure planner; never stored as they are
(a canary's baseline counters are stored inside its `CanaryState`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servekeeper.model.enums import AppSource, AppStatus
from servekeeper.model.routing import HeaderMatch, Mirror


@dataclass(frozen=True)
class BackendCounters:
    """One backend's counters at the ingress, summed over its processes; they only grow
    (unless an ingress process restarted: then they start again from 0)."""

    requests: int = 0  # completed ones (answered or failed: never one in flight)
    errors_5xx: int = 0
    latency_ms_buckets: tuple[tuple[float, int], ...] = ()  # (upper bound, cumulative count), ascending
    epoch: str = ""  # the ingress processes counted: counters of two epochs never compare

    def to_json(self) -> dict[str, Any]:
        buckets = [list(bucket) for bucket in self.latency_ms_buckets]
        return {"requests": self.requests, "errors5xx": self.errors_5xx, "buckets": buckets, "epoch": self.epoch}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BackendCounters:
        buckets = tuple((float(bound), int(count)) for bound, count in data.get("buckets", []))
        return cls(
            requests=int(data["requests"]),
            errors_5xx=int(data["errors5xx"]),
            latency_ms_buckets=buckets,
            epoch=str(data.get("epoch", "")),
        )


@dataclass(frozen=True)
class AppState:
    name: str
    status: AppStatus
    source: AppSource
    message: str = ""
    route_prefix: str | None = None
    last_deployed_time_s: float | None = None
    deployed_config: dict[str, Any] | None = field(default=None, compare=False)  # Ray's deployed_app_config
    running_replicas: int = 0  # replicas in state RUNNING, over the app's deployments
    settled: bool = True  # every deployment HEALTHY: none scaling or updating


@dataclass(frozen=True)
class ProbeState:
    """The latest results of one readiness probe against one cluster."""

    path: str
    passing: bool  # at least successThreshold consecutive passes
    consecutive_successes: int
    success_threshold: int
    last_ok: bool | None = None  # None: not run yet
    last_message: str = ""
    last_time: float | None = None


@dataclass(frozen=True)
class ClusterObservation:
    """What one look at a cluster showed. `None` fields were not reachable."""

    name: str
    processes_alive: bool
    dashboard_ok: bool = False
    apps: dict[str, AppState] | None = None  # None when the Serve API did not answer
    proxy_healthy: bool = False
    routes: frozenset[str] = frozenset()
    probes: tuple[ProbeState, ...] = ()
    dead_workers: int = 0
    # Of those, the worker nodes (by pid) whose process is gone for sure: their host answered.
    # They can be started again where they were; a silent host's node may still run there.
    exited_workers: tuple[int, ...] = ()
    exit_causes: dict[int, str] = field(default_factory=dict)  # exited worker pid -> its log's last lines
    # processes_alive is False because the head's host has not answered since then (on every
    # look): unknown, not dead. The head may still run; only a host that answers says it exited.
    head_silent_since: float | None = None
    # Of the dead workers, those on hosts that did not answer (unknown, not dead), and since when
    # such a host has been silent, on every look since.
    silent_workers: int = 0
    workers_silent_since: float | None = None
    # Worker nodes recorded but not running now (being started, or started again after they
    # exited): a cluster is not ready while any is, even if its apps already run without them.
    nodes_starting: int = 0
    error: str | None = None
    # Which of the configs servekeeper submitted Ray runs now, judged from deployed_app_config.
    deployed_config_hash: str | None = None
    target_capacity: float | None = None  # Ray's, read only for clusters whose capacity is managed


@dataclass(frozen=True)
class IngressRouteObservation:
    active: str | None
    upstreams: frozenset[str]
    inflight: dict[str, int] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)  # empty: only `active` carries traffic
    preview: str | None = None  # the backend the preview port sends to
    failover: bool = False  # a standby stands behind the backends (listed in upstreams at weight 0)
    header_route: HeaderMatch | None = None  # requests matching it go to `header_backend`
    header_backend: str | None = None
    mirror: Mirror | None = None  # requests copied to a canary (a shadow step)

    def weight_of(self, name: str) -> int:
        if self.weights:
            return self.weights.get(name, 0)
        return 100 if name == self.active else 0


@dataclass(frozen=True)
class Observation:
    clusters: dict[str, ClusterObservation]
    route: IngressRouteObservation | None  # None when the ingress has no route for the service
    ingress_ok: bool = True
    # Per backend (cluster), read only while a canary is analysed; None: not read or unreadable.
    backend_counters: dict[str, BackendCounters] | None = None
    placement_problem: str | None = None  # why the next cluster cannot be placed on its host pool now
