"""What the planner asks the controller to do. Plain data; the controller executes them in order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servekeeper.model.enums import ClusterRole
from servekeeper.model.routing import HeaderMatch, Mirror


@dataclass(frozen=True)
class CreateCluster:
    role: ClusterRole
    reason: str


@dataclass(frozen=True)
class StartCluster:
    """The intent was recorded but the processes were never started (a crash in between)."""

    cluster: str


@dataclass(frozen=True)
class RestartNodes:
    """Start these nodes (by pid: they exited) again where they were, in the cluster as
    it is stored when this runs (a start beside the tick may have recorded other nodes since)."""

    cluster: str
    pids: tuple[int, ...]


@dataclass(frozen=True)
class MoveHead:
    """Start the head of `cluster` on another host of its pool, with its GCS tables (Redis): its
    host `silent_host` has not answered for `silent_for` seconds. Every node on that host moves
    with it and the workers are started again against the new head; the nodes left on the
    silent host are stopped once it answers (they may still run there)."""

    cluster: str
    silent_host: str
    silent_for: float


@dataclass(frozen=True)
class SubmitConfig:
    cluster: str
    config_hash: str
    restore: bool = False  # the cluster's last good config, after a failed in-place change


@dataclass(frozen=True)
class UpdateCluster:
    cluster: str
    changes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class UpdateAutoscaler:
    """Give Ray's autoscaler on `cluster` new bounds in place (its monitor re-reads its config at
    each look), then record the cluster as made from `spec_json` (hashed `spec_hash`)."""

    cluster: str
    spec_json: str
    spec_hash: str


@dataclass(frozen=True)
class UpdateClusters:
    """Several clusters' records changed in one transaction (roles swapped: never half done)."""

    changes: tuple[tuple[str, dict[str, Any]], ...]


@dataclass(frozen=True)
class SetRoute:
    """Point the service's ingress port at `active`; `upstreams` also lists clusters still
    draining, so the ingress keeps counting their in-flight requests. A canary takes
    `canary_weight` percent of the traffic from `active`; `preview` is the cluster the
    preview port sends to."""

    active: str
    upstreams: tuple[str, ...]
    canary: str | None = None
    canary_weight: int = 0
    preview: str | None = None
    standby: str | None = None  # listed in upstreams at 0; takes the traffic of a backend that refuses
    # Requests matching `header_route` go to `header_backend` (a canary, listed in upstreams) whatever its weight.
    header_route: HeaderMatch | None = None
    header_backend: str | None = None
    mirror: Mirror | None = None  # a share of the requests copied to a canary (listed in upstreams)

    def weights(self) -> dict[str, int]:
        weights = dict.fromkeys(self.upstreams, 0)
        canary_weight = self.canary_weight if self.canary is not None else 0
        weights[self.active] = 100 - canary_weight
        if self.canary is not None and canary_weight > 0:
            weights[self.canary] = canary_weight
        return weights


@dataclass(frozen=True)
class SetTargetCapacity:
    """PUT the config the cluster runs again with Serve's `target_capacity` (percent of every
    deployment's replicas): the apps stay as they are, only their replica counts change."""

    cluster: str
    capacity: float


@dataclass(frozen=True)
class RemoveRoute:
    pass


@dataclass(frozen=True)
class DeleteCluster:
    cluster: str
    reason: str


@dataclass(frozen=True)
class ForgetService:
    pass


Action = (
    CreateCluster
    | StartCluster
    | RestartNodes
    | MoveHead
    | SubmitConfig
    | UpdateCluster
    | UpdateAutoscaler
    | UpdateClusters
    | SetRoute
    | SetTargetCapacity
    | RemoveRoute
    | DeleteCluster
    | ForgetService
)
